"""The tokenizer fingerprint a shard folder ships with, as its readers check it: the file names, the probe (real
sentences of the corpus and the ids data prep gave them) and the comparison of a tokenizer against it.

The build writes these files (data_prep/tokenizer_files.py); whoever hands the model to a user (the export,
pretrain/checkpointing/export_tokenizer.py) loads the tokenizer the way the user will and checks it against the
probe (`probe_mismatch`). Reading them needs neither the build nor `tokenizers`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from tokenizers.implementations import BaseTokenizer

TOKENIZER_NAME = "tokenizer.json"
PROBE_NAME = "tokenizer_probe.json"

# Sentences for a vocab that came with no corpus probe (shards built before the probe existed): they still catch a
# tokenizer that lost its vocab, its lower-casing or its accent stripping.
FALLBACK_SENTENCES = (
    "The capital of France is Paris, and its river is the Seine.",
    "In 1905, Albert Einstein published four papers on physics.",
    "Zürich's Café Odéon serves naïve tourists a crème brûlée!",
    "She didn't say \"no\" -- she said: maybe (later).",
    "HTTP/2 runs over TCP port 443; the RFC is number 7540.",
    "The quick brown fox jumps over the lazy dog.",
    "Tokyo (東京) is the largest city of Japan.",
    "unbelievably, the committee's decision was reconsidered",
)


@dataclass(frozen=True)
class Probe:
    """Sentences and the ids data prep's tokenizer gave them (no special tokens)."""

    sentences: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]

    @classmethod
    def made_by(cls, tokenizer: Tokenizer | BaseTokenizer, sentences: Sequence[str]) -> Probe:
        encodings = tokenizer.encode_batch(list(sentences), add_special_tokens=False)
        return cls(tuple(sentences), tuple(tuple(e.ids) for e in encodings))

    @classmethod
    def load(cls, path: str | Path) -> Probe:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if len(data["sentences"]) != len(data["ids"]):
            raise ValueError(f"{path}: {len(data['sentences'])} sentences but {len(data['ids'])} id lists")
        return cls(tuple(data["sentences"]), tuple(tuple(int(i) for i in ids) for ids in data["ids"]))

    def to_json(self) -> dict[str, list]:
        return {"sentences": list(self.sentences), "ids": [list(ids) for ids in self.ids]}


def probe_mismatch(probe: Probe, encode: Callable[[str], list[int]]) -> str | None:
    """None when `encode` gives every probe sentence the recorded ids; else what differs, for one short line."""
    for index, (sentence, expected) in enumerate(zip(probe.sentences, probe.ids, strict=True)):
        got = list(encode(sentence))
        if got != list(expected):
            shown = sentence if len(sentence) <= 60 else sentence[:57] + "..."
            first = next((k for k, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                         min(len(got), len(expected)))
            return (f"probe sentence {index + 1} of {len(probe.sentences)} ({shown!r}): ids {got[first:first + 4]} "
                    f"at token {first} where data prep gave {list(expected[first:first + 4])} "
                    f"({len(got)} ids vs {len(expected)})")
    return None
