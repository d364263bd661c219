"""Does the tokenizer fit the model and the task's text? Checked by SQuAD and GLUE before anything trains.

Why (issue 40): an export shipped a 5-token tokenizer (transformers 5 ignores
``BertTokenizerFast(vocab_file=...)``), so every word of SQuAD and GLUE became [UNK] and the fine-tunes
trained and scored on [UNK]s without a word said: the scores were merely low. Nothing downstream can
tell a weak model from a model that never saw the text, so the fine-tunes check what they read, for
any model folder, ours or downloaded:

* the tokenizer belongs to the model: no more ids than the model has embeddings (config.json's
  ``vocab_size``) and, in our export (``export_info.json``'s ``vocab_sha256``), the very vocab the
  model was pretrained with;
* the task's text reads as words: the share of [UNK] among the tokens of a bounded, evenly spread
  sample of the task's text (special tokens aside). Above ``UNK_LIMIT`` (1 %: a fitting WordPiece
  vocab gives well under 0.1 % on English) the fine-tune is refused in one line naming the tokenizer,
  the share and a word that became [UNK], unless ``--allow-unk`` (then that line is a warning).

The share is recorded in results.json under ``vocab_check`` (``VocabCount.as_json``), so a report can
show what the fine-tune saw. No torch here; the tokenizer is whatever the fine-tune loaded.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.errors import FinetuneFormatError
from pretrain.run_folder import EXPORT_INFO

UNK_LIMIT = 0.01  # above this share of [UNK] the tokenizer does not fit the text
SAMPLE_TEXTS = 2000  # distinct texts tokenised at most (contexts, questions, sentences): about a second
# No percent sign: argparse formats help strings with %.
ALLOW_UNK_DOC = (f"fine-tune even when more than 1 in {round(1 / UNK_LIMIT)} of the task's tokens is [UNK] (the "
                 "tokenizer does not fit the text, e.g. an export with a broken tokenizer: refused by default)")


@dataclass(frozen=True)
class VocabCheck:
    """What the check reads: the tokenizer the fine-tune loaded, the folder it and the model came from,
    the model's config.json, the task's raw text; and how to answer (the command's error kind, the flag)."""

    tokenizer: Any
    model_dir: Path
    model_config: dict[str, Any]
    texts: Iterable[str]
    allow_unk: bool = False
    error: type[FinetuneFormatError] = FinetuneFormatError
    speak: bool = True  # print the warning line (rank 0 only: every rank checks, one says it)


@dataclass(frozen=True)
class VocabCount:
    """The [UNK] share the fine-tune saw: what results.json records under ``vocab_check``."""

    tokenizer: str  # its folder or name
    tokenizer_size: int  # len(tokenizer)
    texts: int  # distinct texts tokenised (a sample of the task's)
    tokens: int  # their tokens, special tokens aside
    unk_tokens: int
    unk_example: str | None  # a word of the text whose tokenization is [UNK]

    @property
    def unk_share(self) -> float:
        return self.unk_tokens / self.tokens if self.tokens else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "tokenizer_size": self.tokenizer_size, "texts": self.texts,
                "tokens": self.tokens, "unk_tokens": self.unk_tokens, "unk_share": self.unk_share,
                "unk_example": self.unk_example, "unk_limit": UNK_LIMIT}


def tokenizer_name(tokenizer: Any, model_dir: Path) -> str:
    """The folder (or hub name) the tokenizer was loaded from; the model's folder when it does not say."""
    return str(getattr(tokenizer, "name_or_path", "") or model_dir)


def check_vocab(check: VocabCheck) -> VocabCount:
    """Refuse a tokenizer that is not the model's, or one under which the task's text is mostly [UNK]
    (``check.error``, one line); return the count for results.json."""
    refuse_foreign_tokenizer(check)
    count = count_unk(check.tokenizer, check.texts, tokenizer_name(check.tokenizer, check.model_dir))
    if count.unk_share > UNK_LIMIT:
        line = (f"--model {check.model_dir}: {count.unk_share:.1%} of the task's tokens are [UNK] under the "
                f"tokenizer {count.tokenizer} ({count.tokenizer_size} tokens; {count.unk_example!r} became [UNK], "
                f"{count.tokens} tokens of {count.texts} texts counted): it does not fit this text")
        if not check.allow_unk:
            raise check.error(f"{line}; pass --allow-unk to fine-tune anyway")
        if check.speak:
            print(f"warning: {line}; fine-tuning anyway (--allow-unk)", file=sys.stderr, flush=True)
    return count


def refuse_foreign_tokenizer(check: VocabCheck) -> None:
    """One line naming both when the tokenizer has more ids than the model's embeddings, or is not the vocab
    our export says the model was pretrained with."""
    tokenizer, folder = check.tokenizer, Path(check.model_dir)
    name, size = tokenizer_name(tokenizer, folder), len(tokenizer)
    model_size = check.model_config.get("vocab_size")
    if isinstance(model_size, int) and size > model_size:
        raise check.error(f"--model {folder}: the tokenizer {name} has {size} tokens, more than the model's "
                          f"{model_size} embeddings (vocab_size in {folder / 'config.json'}): they do not belong "
                          "together")
    expected = export_vocab_sha256(folder)
    if expected is None:
        return
    tokens = tokens_by_id(tokenizer)
    ours = vocab_sha256(tokens)
    if ours != expected and tokens != vocab_file_tokens(folder / "vocab.txt", expected):
        raise check.error(f"--model {folder}: the tokenizer {name} ({size} tokens, vocab sha256 {ours[:12]}) is not "
                          f"the vocab the model was pretrained with ({folder / EXPORT_INFO}: vocab_sha256 "
                          f"{expected[:12]}); load the model with its own tokenizer (re-export it)")


def export_vocab_sha256(folder: Path) -> str | None:
    """The sha256 of the vocab our export says the model was pretrained with; None for other folders."""
    try:
        info = json.loads((folder / EXPORT_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sha = info.get("vocab_sha256") if isinstance(info, dict) else None
    return sha if isinstance(sha, str) and sha else None


def tokens_by_id(tokenizer: Any) -> list[str]:
    """The tokenizer's vocab in id order (a vocab.txt's lines)."""
    return [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]


def vocab_sha256(tokens: Sequence[str]) -> str:
    """sha256 of `tokens` written as a vocab.txt: one a line (data_prep writes them so)."""
    return hashlib.sha256(("\n".join(tokens) + "\n").encode("utf-8")).hexdigest()


def vocab_file_tokens(path: Path, sha: str) -> list[str] | None:
    """The lines of the folder's vocab.txt when its bytes are the vocab `sha` names (one written with other
    line ends or without a last newline); None otherwise."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != sha:
        return None
    lines = [line.rstrip("\r") for line in data.decode("utf-8", errors="replace").split("\n")]
    return lines[:-1] if lines and lines[-1] == "" else lines


def sample(texts: Iterable[str], limit: int = SAMPLE_TEXTS) -> list[str]:
    """At most `limit` distinct non-empty texts, spread evenly over the task's (a context is asked about many
    times; the last articles count as much as the first)."""
    distinct = list(dict.fromkeys(text for text in texts if text and text.strip()))
    if len(distinct) <= limit:
        return distinct
    step = len(distinct) / limit
    return [distinct[int(i * step)] for i in range(limit)]


def count_unk(tokenizer: Any, texts: Iterable[str], name: str) -> VocabCount:
    """The [UNK] tokens among the tokens of a sample of `texts` (the special ids aside, [UNK] counted)."""
    chosen = sample(texts)
    unk = tokenizer.unk_token_id
    special = set(tokenizer.all_special_ids) - {unk}
    offsets = bool(getattr(tokenizer, "is_fast", False))
    encoded = tokenizer(chosen, add_special_tokens=False, return_offsets_mapping=offsets, verbose=False) \
        if chosen else {"input_ids": []}
    tokens = unk_tokens = 0
    example: str | None = None
    for row, ids in enumerate(encoded["input_ids"]):
        kept = [token for token in ids if token not in special]
        tokens += len(kept)
        found = sum(1 for token in kept if token == unk) if unk is not None else 0
        unk_tokens += found
        if found and example is None:
            spans = encoded["offset_mapping"][row] if offsets else None
            example = unk_word(tokenizer, chosen[row], ids, spans)
    return VocabCount(name, len(tokenizer), len(chosen), tokens, unk_tokens, example)


def unk_word(tokenizer: Any, text: str, ids: Sequence[int], spans: Sequence[tuple[int, int]] | None) -> str | None:
    """A word of `text` that became [UNK]: the characters of its first [UNK] token (a fast tokenizer's
    offsets), else the first whitespace-separated word whose tokenization holds [UNK]."""
    unk = tokenizer.unk_token_id
    if spans is not None:
        start, end = next(span for token, span in zip(ids, spans, strict=True) if token == unk)
        if end > start:
            return text[start:end]
    for word in text.split():
        if unk in tokenizer(word, add_special_tokens=False)["input_ids"]:
            return word
    return None
