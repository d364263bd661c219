"""The WordPiece vocab of a shard folder: one `Vocab` for the build (load or train it, tokenize with it) and the
ranks (ids of the special tokens, whole-word pieces, the ids a random replacement may take, its sha256).

Loading is one rule for both: a vocab.txt is its lines in order (a line's id is its index), UTF-8, without
duplicates. The build needs all five special tokens (`load_vocab`); the ranks need the four that masking and
collate use (`Vocab.load`): a foreign vocab without [UNK] trains, with [PAD] standing in where [UNK] is kept out.
`tokenizers` is imported only where a tokenizer is built or trained, so a rank that reads shards does not load it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data_prep.shard_format.atomic_io import atomic_write_bytes, sha256_file
from data_prep.shard_format.masking import SpecialIds, replacement_ids

if TYPE_CHECKING:
    from tokenizers import BertWordPieceTokenizer

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MASKING_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")  # what collate and masking look up (a rank needs these)


class VocabError(ValueError):
    """The vocab file is missing, unreadable, or lacks a special token; names the file."""


@dataclass(frozen=True)
class Vocab:
    """A vocab file's tokens in id order, and whether it is uncased. The derived values are computed once, on
    first use (a rank's collate reads them every micro-batch)."""

    path: Path
    tokens: tuple[str, ...]
    lowercase: bool

    @classmethod
    def load(cls, path: str | Path, required: tuple[str, ...] = MASKING_TOKENS, flag: str = "") -> Vocab:
        """The vocab at `path`; VocabError (prefixed with `flag`, e.g. "--vocab ", when given) when the file is
        missing, unreadable, not UTF-8, has duplicate lines or lacks one of the `required` tokens."""
        path = Path(path)
        name = f"{flag}{path}"
        if not path.is_file():
            raise VocabError(f"{name}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise VocabError(f"{name}: unreadable or not UTF-8 ({err})") from err
        tokens = tuple(line.rstrip("\r") for line in text.split("\n"))
        if tokens and tokens[-1] == "":
            tokens = tokens[:-1]
        missing = [tok for tok in required if tok not in tokens]
        if missing:
            raise VocabError(f"{name}: lacks the special token(s) {' '.join(missing)}")
        if len(set(tokens)) != len(tokens):
            raise VocabError(f"{name}: has duplicate lines")
        return cls(path=path, tokens=tokens, lowercase=_looks_uncased(tokens))

    @property
    def size(self) -> int:
        return len(self.tokens)

    @cached_property
    def index(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}

    @property
    def special_ids(self) -> dict[str, int]:
        """The id of each of the five special tokens the vocab has."""
        return {tok: self.index[tok] for tok in SPECIAL_TOKENS if tok in self.index}

    @cached_property
    def special(self) -> SpecialIds:
        """The ids masking uses; [PAD] stands in for a missing [UNK] (one id fewer to keep out)."""
        ids = self.index
        return SpecialIds(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[PAD]"], ids.get("[UNK]", ids["[PAD]"]))

    @property
    def cls_id(self) -> int:
        return self.special.cls

    @property
    def sep_id(self) -> int:
        return self.special.sep

    @property
    def mask_id(self) -> int:
        return self.special.mask

    @property
    def pad_id(self) -> int:
        return self.special.pad

    @property
    def unk_id(self) -> int | None:
        """None: a vocab without [UNK] (data prep's always has one)."""
        return self.index.get("[UNK]")

    @cached_property
    def is_continuation(self) -> np.ndarray:
        """bool[size]: True for WordPiece '##' pieces, which whole-word masking groups with the piece before."""
        return np.array([tok.startswith("##") for tok in self.tokens], dtype=bool)

    def continuation_mask(self) -> np.ndarray:
        return self.is_continuation

    @cached_property
    def replacements(self) -> np.ndarray:
        """The ids a random MLM replacement may take (data_prep/shard_format/masking.py `replacement_ids`)."""
        return replacement_ids(self.size, self.special)

    @cached_property
    def sha256(self) -> str:
        return sha256_file(self.path)

    def tokenizer(self) -> BertWordPieceTokenizer:
        from tokenizers import BertWordPieceTokenizer

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
    """A vocab the build tokenizes with: all five special tokens; errors name the --vocab flag."""
    return Vocab.load(path, SPECIAL_TOKENS, flag="--vocab ")


def train_vocab(sentences: Iterable[str], vocab_size: int, lowercase: bool, out_path: Path) -> Vocab:
    """Train WordPiece on the cleaned corpus and save it as `out_path` (a vocab.txt)."""
    from tokenizers import BertWordPieceTokenizer

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
