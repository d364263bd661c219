"""The WordPiece vocab of a shard folder: one `Vocab` for the build (load or train it, tokenize with it) and the
ranks (ids of the special tokens, whole-word pieces, the ids a random replacement may take, its sha256).

Loading is one rule for both: a vocab.txt is its lines in order (a line's id is its index), UTF-8, without
duplicates. The build needs all five special tokens (`load_vocab`); the ranks need the four that masking and
collate use (`Vocab.load`): a foreign vocab without [UNK] trains, with [PAD] standing in where [UNK] is kept out.
`tokenizers` is imported only where a tokenizer is built or trained, so a rank that reads shards does not load it.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
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


ALPHABET_LIMIT = 1000  # the characters a trained vocab keeps, most frequent first (`tokenizers`' default)
CONTINUING_PREFIX = "##"  # WordPiece's mark of a piece that continues a word


def train_vocab(read_sentences: Callable[[], Iterable[str]], vocab_size: int, lowercase: bool, out_path: Path
                ) -> Vocab:
    """Train WordPiece on the cleaned corpus and save it as `out_path` (a vocab.txt); the same text gives the same
    file, in any process on any machine.

    `tokenizers`' trainer alone does not (issue 1794 of its tracker; measured: three trainings of the tests' facts
    corpus in one process, three different token sets). It gives the word-continuing pieces ("##e") their ids in
    hash-map order as it first meets them, and breaks ties between equal merge counts by those ids, so a tie can keep
    different merges; its alphabet cut (the most frequent characters) also orders equal counts arbitrarily. Both are
    settled here, for one more read of the text (`read_sentences` is called twice): the characters are counted
    first, the alphabet chosen (most frequent first, ties by code point) and handed over whole, and the "##c" of
    every alphabet character that can continue a word is registered before training, in code-point order, so every
    id a tie-break reads is fixed before the first merge. The ids of the written file do not come from the trainer
    at all: the specials, then the learned tokens sorted."""
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=lowercase, clean_text=True)
    alphabet, continuing = chosen_alphabet(tokenizer, read_sentences())
    tokenizer.train_from_iterator(
        read_sentences(),
        vocab_size=vocab_size,
        min_frequency=2,
        limit_alphabet=len(alphabet),
        initial_alphabet=alphabet,
        special_tokens=[*SPECIAL_TOKENS, *(CONTINUING_PREFIX + char for char in continuing)],
        show_progress=False,
        wordpieces_prefix=CONTINUING_PREFIX,
    )
    learned = set(tokenizer.get_vocab()) - set(SPECIAL_TOKENS)
    tokens = [*SPECIAL_TOKENS, *sorted(learned)]
    atomic_write_bytes(out_path, ("\n".join(tokens) + "\n").encode("utf-8"))
    return load_vocab(out_path)


def chosen_alphabet(tokenizer: BertWordPieceTokenizer, sentences: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the alphabet: the ALPHABET_LIMIT characters most frequent in the words the trainer will see, ties by code
    point; those of them that can continue a word, in code-point order). The raw characters are counted, then each
    distinct one is put through the tokenizer's own normaliser (its steps, lower-casing, accent stripping, control
    characters, act on one character at a time, so the counts are those of the normalised text; normalising the text
    itself ran at 3 MB/s); where a character stands is asked of its own pre-tokenizer: between two letters it is
    part of the word, or split off (punctuation, CJK), or not in any word (whitespace)."""
    raw = np.zeros(sys.maxunicode + 1, dtype=np.int64)  # per code point
    for batch in text_batches(sentences):
        raw += np.bincount(np.frombuffer(batch.encode("utf-32-le"), dtype=np.uint32), minlength=raw.size)
    counts: Counter[str] = Counter()
    for code in np.flatnonzero(raw):
        for normalised in tokenizer.normalizer.normalize_str(chr(code)):
            counts[normalised] += int(raw[code])
    continues, alone = set(), set()
    for char in counts:
        words = [word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(
            tokenizer.normalizer.normalize_str(f"a{char}a"))]
        if words == [f"a{char}a"]:
            continues.add(char)
        elif char in words:
            alone.add(char)
    ranked = sorted(continues | alone, key=lambda char: (-counts[char], ord(char)))[:ALPHABET_LIMIT]
    return sorted(ranked, key=ord), sorted(continues.intersection(ranked), key=ord)


def text_batches(sentences: Iterable[str], size: int = 1 << 22) -> Iterator[str]:
    """The sentences joined by newlines (whitespace, as between words) into strings of about `size` characters."""
    batch: list[str] = []
    length = 0
    for sentence in sentences:
        batch.append(sentence)
        length += len(sentence) + 1
        if length >= size:
            yield "\n".join(batch)
            batch, length = [], 0
    if batch:
        yield "\n".join(batch)
