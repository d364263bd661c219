"""Where each input shard's documents and chunks sit in the corpus, and which documents are held out.

Read from the markers of the corpus stage (data_prep/work_layout.py), so any process (the merge, one SLURM
array element) gets it without opening a data file. Documents and chunks are numbered over the whole corpus
in plan order: an instance task's random draws are seeded by its global chunk number, and the validation
split draws per global document index, so that a corpus of one input shard is numbered as every build
before input shards was.

The held-out draw is the same as before: document d is held out when draw d of the generator seeded
(seed, 0x7A1) is below --val-fraction (and when none is, the one with the smallest draw). A task reads only
its shard's draws: the generator (PCG64, one 64-bit step per float64 draw) jumps to the shard's first
document in constant time, so nothing of the corpus' size is drawn or held.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.work_layout import CLEAN_STAGE, TOKENS_STAGE, marker_path

# Input documents left out for being over a cap (data_prep/config.py: DocumentLimits) under --skip-bad-files:
# in a clean marker and the manifest's totals only when there were some, so other builds keep their bytes.
DOCUMENTS_SKIPPED = "documents_skipped_over_limits"
_VAL_ENTROPY = 0x7A1
_DRAW_BLOCK = 1 << 20  # documents drawn at a time when a draw must scan the corpus (8 MiB)


class CorpusNotReady(RuntimeError):
    """A shard's corpus stage has not finished (no marker)."""


@dataclass(frozen=True)
class ShardSpan:
    doc_start: int  # global index of the shard's first document
    documents: int
    chunk_base: int  # global number of the shard's first chunk
    chunk_documents: tuple[int, ...]  # documents of each chunk (after cleaning and tokenizing)

    @property
    def doc_end(self) -> int:
        return self.doc_start + self.documents


@dataclass(frozen=True)
class CorpusIndex:
    spans: tuple[ShardSpan, ...]
    totals: dict[str, int]

    @property
    def documents(self) -> int:
        return self.spans[-1].doc_end if self.spans else 0


def missing_corpus_shards(out: Path, num_shards: int) -> list[int]:
    return [s for s in range(num_shards) if not marker_path(out, TOKENS_STAGE, s).is_file()]


@functools.lru_cache(maxsize=2)
def corpus_index(out: Path, num_shards: int) -> CorpusIndex:
    missing = missing_corpus_shards(out, num_shards)
    if missing:
        raise CorpusNotReady(f"{out}: input shard(s) {missing[:5]} not yet cleaned and tokenized")
    spans: list[ShardSpan] = []
    totals: dict[str, int] = {}
    doc_start = chunk_base = 0
    for shard in range(num_shards):
        clean = json.loads(marker_path(out, CLEAN_STAGE, shard).read_text(encoding="utf-8"))
        tokens = json.loads(marker_path(out, TOKENS_STAGE, shard).read_text(encoding="utf-8"))
        chunks = tuple(int(n) for n in tokens["chunk_documents"])
        spans.append(ShardSpan(doc_start, int(tokens["documents"]), chunk_base, chunks))
        doc_start += int(tokens["documents"])
        chunk_base += len(chunks)
        for key in ("input_documents", "documents_dropped_short", "characters", "documents", "sentences", "tokens"):
            totals[key] = totals.get(key, 0) + int((clean | tokens)[key])
        if clean.get(DOCUMENTS_SKIPPED):
            totals[DOCUMENTS_SKIPPED] = totals.get(DOCUMENTS_SKIPPED, 0) + int(clean[DOCUMENTS_SKIPPED])
    return CorpusIndex(tuple(spans), dict(sorted(totals.items())))


def _draws(seed: int, start: int, count: int) -> np.ndarray:
    generator = np.random.PCG64(np.random.SeedSequence([seed, _VAL_ENTROPY]))
    generator.advance(start)
    return np.random.Generator(generator).random(count)


@functools.lru_cache(maxsize=4)
def fallback_document(num_documents: int, val_fraction: float, seed: int) -> int | None:
    """The document held out because no draw fell below the fraction (the smallest draw), or None. The scan
    stops at the first draw that does fall below, which on any real corpus is within the first block."""
    best, best_at = 2.0, 0
    for start in range(0, num_documents, _DRAW_BLOCK):
        draws = _draws(seed, start, min(_DRAW_BLOCK, num_documents - start))
        if (draws < val_fraction).any():
            return None
        at = int(np.argmin(draws))
        if draws[at] < best:
            best, best_at = float(draws[at]), start + at
    return best_at


def held_out(start: int, count: int, num_documents: int, val_fraction: float, seed: int) -> np.ndarray:
    """Whether documents start .. start+count-1 are held out, as the whole-corpus draw decides it."""
    if val_fraction <= 0 or num_documents < 2:
        return np.zeros(count, dtype=bool)
    mask = _draws(seed, start, count) < val_fraction
    fallback = fallback_document(num_documents, val_fraction, seed)
    if fallback is not None and start <= fallback < start + count:
        mask[fallback - start] = True
    return mask


class DocumentSplits:
    """The split of each document in a range (an input shard, or the corpus), and each split's documents
    in it: the pool a random next segment is drawn from (8 bytes per document of the range)."""

    def __init__(self, start: int, count: int, num_documents: int, val_fraction: float, seed: int) -> None:
        self.start = start
        self.held_out = held_out(start, count, num_documents, val_fraction, seed)
        self.pools = {"train": np.flatnonzero(~self.held_out) + start, "val": np.flatnonzero(self.held_out) + start}

    def split_of(self, document: int) -> str:
        return "val" if self.held_out[document - self.start] else "train"


def count_held_out(num_documents: int, val_fraction: float, seed: int) -> int:
    """Held-out documents of the corpus, counted in blocks (for the manifest's totals)."""
    return sum(int(held_out(start, min(_DRAW_BLOCK, num_documents - start), num_documents, val_fraction, seed).sum())
               for start in range(0, num_documents, _DRAW_BLOCK))
