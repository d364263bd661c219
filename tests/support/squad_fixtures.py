"""Tiny SQuAD files and tiny BERT folders for the SQuAD tests (built in tmp_path, never downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

# Hand-written paragraphs (ours, not SQuAD's): enough text for a WordPiece vocab and several
# windows per paragraph at short sequence lengths.
PARAGRAPHS = [
    (
        "The lighthouse at Karsby Point was built in 1871 by the engineer Marta Lund. Its lamp was first "
        "lit with whale oil, later with kerosene, and since 1954 with electricity. The tower is 31 metres "
        "tall and is painted with red and white bands so that sailors can see it during the day.",
        [
            ("Who built the lighthouse at Karsby Point?", "Marta Lund"),
            ("When was the lighthouse built?", "1871"),
            ("How tall is the tower?", "31 metres"),
            ("What has powered the lamp since 1954?", "electricity"),
        ],
    ),
    (
        "Bread in the village of Ostra Vik is baked every morning by the cooperative bakery. The bakery uses "
        "rye flour from the mill on the river, and the most popular loaf is a dark sourdough called "
        "svartbrod. On Saturdays the bakers also make cardamom buns, which sell out before nine o'clock.",
        [
            ("Who bakes the bread in Ostra Vik?", "the cooperative bakery"),
            ("What is the most popular loaf called?", "svartbrod"),
            ("What do the bakers make on Saturdays?", "cardamom buns"),
            ("Where does the rye flour come from?", "the mill on the river"),
        ],
    ),
    (
        "The annual rowing race between the two colleges starts at the old stone bridge and ends at the "
        "boathouse, a distance of about four kilometres. In the first race, held in 1902, the crews rowed "
        "in heavy wooden boats. Today the boats are made of carbon fibre and weigh less than ninety kilograms.",
        [
            ("Where does the rowing race start?", "the old stone bridge"),
            ("How long is the race?", "about four kilometres"),
            ("When was the first race held?", "1902"),
            ("What are the boats made of today?", "carbon fibre"),
        ],
    ),
]


SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def squad_articles(repeat: int = 1) -> list[dict]:
    """Official-layout ``data``: the paragraphs above (``repeat`` copies with distinct ids)."""
    articles = []
    for copy in range(repeat):
        paragraphs = []
        for p_index, (context, qas) in enumerate(PARAGRAPHS):
            items = []
            for q_index, (question, answer) in enumerate(qas):
                start = context.index(answer)
                items.append({
                    "id": f"q{copy}-{p_index}-{q_index}",
                    "question": question,
                    "answers": [{"text": answer, "answer_start": start}],
                })
            paragraphs.append({"context": context, "qas": items})
        articles.append({"title": f"Fixture_{copy}", "paragraphs": paragraphs})
    return articles


def write_squad(path: Path, repeat: int = 1) -> Path:
    path.write_text(json.dumps({"data": squad_articles(repeat), "version": "1.1"}), encoding="utf-8")
    return path


def fixture_vocab() -> dict[str, int]:
    """WordPiece ids for the fixture text, the same in every process: the specials, each character (alone and
    as a ``##`` continuation, so any word can still be spelled), then every whole word, each group sorted.

    Not ``WordPieceTrainer``: its merges break count ties in hash-map order, which changes with each process
    (398 or 399 tokens, other ids), so every test process got another tiny model, and a check on a 3-step
    loss passed or failed with the draw."""
    from tokenizers import normalizers, pre_tokenizers

    normalizer, splitter = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    texts = [context + " " + " ".join(q for q, _ in qas) for context, qas in PARAGRAPHS]
    words = {word for text in texts for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text))}
    chars = sorted({char for word in words for char in word})
    tokens = [*SPECIAL_TOKENS, *chars, *(f"##{char}" for char in chars), *sorted(words - set(chars))]
    return {token: index for index, token in enumerate(tokens)}


def build_tokenizer():
    """A BERT WordPiece fast tokenizer over ``fixture_vocab`` (lower case, BERT's splitting and specials)."""
    return wordpiece_tokenizer(fixture_vocab())


def wordpiece_tokenizer(vocab: dict[str, int]):
    """A BERT WordPiece fast tokenizer over `vocab` (token -> id; it must hold SPECIAL_TOKENS): lower case,
    BERT's splitting and specials. Built from a `tokenizers` object, as transformers 5 ignores
    ``BertTokenizerFast(vocab_file=...)`` (issue 40: it gives a 5-token tokenizer); check ``len()``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.BertProcessing(("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )


def build_tiny_bert(folder: Path, head: str = "pretraining", seed: int = 0) -> Path:
    """save_pretrained a tiny random BertForPreTraining (our export of an MLM + NSP run), BertForMaskedLM (our
    export of an MLM-only run: `head="masked_lm"`) or BertForQuestionAnswering."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering

    tokenizer = build_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
    )
    if head == "masked_lm":
        config.next_sentence_prediction = False  # as pretrain/model/bert.py records an MLM-only run
    torch.manual_seed(seed)
    classes = {"pretraining": BertForPreTraining, "masked_lm": BertForMaskedLM, "qa": BertForQuestionAnswering}
    model = classes[head](config)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def replace_tokenizer(folder: Path, tokenizer) -> Path:
    """`folder` (a model folder) with `tokenizer` in place of its own: the tokenizer files go, the new ones are saved."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (folder / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(str(folder))
    return folder


# Short SQuAD windows that keep a tiny model quick; the fine-tune tests and the script they launch share them.
SHORT_WINDOWS = ["--max-seq-length", "48", "--doc-stride", "20", "--max-query-length", "16"]
