"""What an export knows: one word masked in each of a set of real sentences, filled by the model and by the same
model with random weights.

Losses that fall and files that load say that the machinery ran, not that the model learned language: a tokenizer
that turns every word into [UNK] trains and exports just as well. This readout asks the question a user asks, the
way they ask it (the export folder through `AutoTokenizer` and `AutoModelForMaskedLM`): given a sentence with one
whole word hidden, which word does the model put there? The random-weights twin of the same shape, through the same
tokenizer, is the floor: a trained model that does no better learned nothing.

The sentences are the shards' probe (data_prep/shard_format/tokenizer_probe.py): text of the training corpus, so the figure says
what pretraining stored, not how it generalises.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

MIN_WORD_CHARS = 4  # short words (the, of, and) are guessed from frequency alone; a longer word needs the context


@dataclass(frozen=True)
class Guesses:
    """How one model did on the masked sentences: the share it put back exactly, within its 10 best guesses, and the
    median rank of the hidden word among all tokens (1 = its best guess; a model that knows nothing ranks it about
    halfway down the vocab). The rank moves long before top-1 does, so it shows what a short run learned."""

    top1: float
    top10: float
    median_rank: float


@dataclass(frozen=True)
class FillMaskReadout:
    """The export and its random-weights twin on `sentences` masked sentences, and a few of the export's guesses."""

    sentences: int
    trained: Guesses
    random: Guesses
    examples: tuple[tuple[str, str, tuple[str, ...]], ...]  # (masked text, the hidden word, the model's top 3)


def masked_position(ids: list[int], tokens: list[str], special_ids: set[int]) -> int | None:
    """A whole word of one WordPiece token and at least MIN_WORD_CHARS letters, the middle one of those the sentence
    has (deterministic); None when it has none."""
    candidates = [
        k for k, (token_id, token) in enumerate(zip(ids, tokens, strict=True))
        if token_id not in special_ids and not token.startswith("##") and token.isalpha()
        and len(token) >= MIN_WORD_CHARS and not (k + 1 < len(tokens) and tokens[k + 1].startswith("##"))
    ]
    return candidates[len(candidates) // 2] if candidates else None


@torch.no_grad()
def read_fill_mask(model_dir: Path, sentences: list[str], shown: int = 3, seed: int = 0) -> FillMaskReadout:
    """Mask one word per sentence (`masked_position`), fill it with the export and with random weights."""
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # an MLM+NSP export loads as a masked LM without its NSP head: said, not news
    hf_logging.disable_progress_bar()
    try:
        trained = AutoModelForMaskedLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    torch.manual_seed(seed)
    random = AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(str(model_dir), local_files_only=True)).eval()
    special = set(tokenizer.all_special_ids)
    limit = min(tokenizer.model_max_length, trained.config.max_position_embeddings)
    ranks: dict[str, list[int]] = {"trained": [], "random": []}
    examples: list[tuple[str, str, tuple[str, ...]]] = []
    for sentence in sentences:
        ids = tokenizer(sentence, truncation=True, max_length=limit)["input_ids"]
        position = masked_position(ids, tokenizer.convert_ids_to_tokens(ids), special)
        if position is None:
            continue
        answer = ids[position]
        masked = [*ids[:position], tokenizer.mask_token_id, *ids[position + 1:]]
        batch = torch.tensor([masked])
        for name, model in (("trained", trained), ("random", random)):
            logits = model(input_ids=batch, attention_mask=torch.ones_like(batch)).logits[0, position]
            ranks[name].append(1 + int((logits > logits[answer]).sum()))
            if name == "trained" and len(examples) < shown:
                top = tuple(tokenizer.convert_ids_to_tokens(logits.topk(3).indices.tolist()))
                examples.append((tokenizer.decode(masked[1:-1]), tokenizer.convert_ids_to_tokens(answer), top))
    return FillMaskReadout(len(ranks["trained"]), guesses(ranks["trained"]), guesses(ranks["random"]),
                           tuple(examples))


def guesses(ranks: list[int]) -> Guesses:
    if not ranks:
        return Guesses(0.0, 0.0, float("nan"))
    return Guesses(sum(r == 1 for r in ranks) / len(ranks), sum(r <= 10 for r in ranks) / len(ranks),
                   float(statistics.median(ranks)))
