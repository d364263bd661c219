"""WordPiece vocab: load a vocab.txt (checked) or train one with `tokenizers`; build the tokenizer."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import BertWordPieceTokenizer

from data_prep.atomic_io import atomic_write_bytes

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class VocabError(ValueError):
    """The vocab file is missing, unreadable, or lacks a special token; names the file."""


@dataclass(frozen=True)
class Vocab:
    path: Path
    tokens: tuple[str, ...]
    lowercase: bool

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def special_ids(self) -> dict[str, int]:
        return {tok: self.tokens.index(tok) for tok in SPECIAL_TOKENS}

    def continuation_mask(self) -> np.ndarray:
        """True for '##' pieces: whole-word masking groups them with the piece before."""
        return np.array([tok.startswith("##") for tok in self.tokens], dtype=bool)

    def tokenizer(self) -> BertWordPieceTokenizer:
        # Lower-casing and accent stripping follow the vocab: an uncased vocab has neither case
        # nor accents, so text must be normalised the same way or most words become [UNK].
        return BertWordPieceTokenizer(
            str(self.path), lowercase=self.lowercase, strip_accents=self.lowercase, clean_text=True
        )


def _looks_uncased(tokens: Iterable[str]) -> bool:
    """bert-base-uncased has no upper-case letters outside [SPECIAL] tokens; cased vocabs have many."""
    upper = sum(1 for tok in tokens if not (tok.startswith("[") and tok.endswith("]")) and tok != tok.lower())
    return upper == 0


def load_vocab(path: str | Path) -> Vocab:
    path = Path(path)
    if not path.is_file():
        raise VocabError(f"--vocab {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise VocabError(f"--vocab {path}: unreadable or not UTF-8 ({err})") from err
    tokens = tuple(line.rstrip("\r") for line in text.split("\n"))
    if tokens and tokens[-1] == "":
        tokens = tokens[:-1]
    missing = [tok for tok in SPECIAL_TOKENS if tok not in tokens]
    if missing:
        raise VocabError(f"--vocab {path}: lacks the special token(s) {' '.join(missing)}")
    if len(set(tokens)) != len(tokens):
        raise VocabError(f"--vocab {path}: has duplicate lines")
    return Vocab(path=path, tokens=tokens, lowercase=_looks_uncased(tokens))


def train_vocab(sentences: Iterable[str], vocab_size: int, lowercase: bool, out_path: Path) -> Vocab:
    """Train WordPiece on the cleaned corpus and save it as `out_path` (a vocab.txt)."""
    tokenizer = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=lowercase, clean_text=True)
    tokenizer.train_from_iterator(
        sentences,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        wordpieces_prefix="##",
    )
    # The trainer's id order varies from run to run (hash-map order of the alphabet), although
    # the token set does not. WordPiece matching ignores ids, so a canonical order (specials,
    # then sorted) makes the file, and every id in the shards, reproducible.
    learned = set(tokenizer.get_vocab()) - set(SPECIAL_TOKENS)
    tokens = [*SPECIAL_TOKENS, *sorted(learned)]
    atomic_write_bytes(out_path, ("\n".join(tokens) + "\n").encode("utf-8"))
    return load_vocab(out_path)
