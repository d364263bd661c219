"""Inputs the segment-mode tests write themselves: a one-sentence-per-line corpus and its vocab.

Self-contained on purpose (no shared fixture): `test_nsp_unchanged.py` pins the sha256 of shards built
from exactly these bytes, so an edit elsewhere must not move them. Only `random.Random(int)` draws,
whose sequence Python keeps stable across versions.
"""

from __future__ import annotations

import random
from pathlib import Path

from data_prep.__main__ import main

WORDS = (
    "river mountain city history language music science people empire north south ancient modern village "
    "council trade market harbour winter summer station railway bridge castle forest painter writer scholar "
    "museum library garden theatre festival island valley province"
).split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def write_corpus(path: Path, documents: int = 40, seed: int = 37) -> None:
    """Documents of 1 to 25 sentences of 3 to 20 words; every 7th document also holds one sentence of
    60 to 90 words, longer than a seq-64 instance can hold (BERT truncates it, packing must split it)."""
    rng = random.Random(seed)
    docs = []
    for index in range(documents):
        lines = [_sentence(rng, rng.randint(3, 20)) for _ in range(rng.randint(1, 25))]
        if index % 7 == 3:
            lines.insert(rng.randrange(len(lines) + 1), _sentence(rng, rng.randint(60, 90)))
        docs.append("\n".join(lines))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")


def write_vocab(path: Path) -> None:
    """Uncased: the special tokens, '.', the letters and their '##' pieces, then WORDS but the last six,
    which therefore become several pieces (whole-word masking has words to keep together). No [UNK]."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *letters, *(f"##{c}" for c in letters), *WORDS[:-6]]
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")


def write_inputs(root: Path) -> Path:
    """The corpus and its vocab in `root` (what the tests' module fixtures build once)."""
    root.mkdir(parents=True, exist_ok=True)
    write_corpus(root / "corpus.txt")
    write_vocab(root / "vocab.txt")
    return root


def build(corpus: Path, out: Path, *flags: str, seed: int = 7) -> int:
    """`python -m data_prep build` of the corpus in `corpus` (write_inputs) into `out`, with more flags."""
    return main(["build", "--text", str(corpus / "corpus.txt"), "--vocab", str(corpus / "vocab.txt"),
                 "--seed", str(seed), "--out", str(out), *flags])
