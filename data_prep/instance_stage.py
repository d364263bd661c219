"""Stage 2: tokenized corpus -> instances, one file per (sequence length, chunk, split).

Each chunk's instances are a pure function of (seed, sequence length, chunk index, corpus):
its rng is seeded from those alone, so neither the worker count nor the node count changes a
byte. Random "next" segments come from any document of the same split, across the whole corpus.

`full-sentences` packs across documents, but only across the documents of one chunk and split:
the packing starts afresh at every chunk, so a chunk never waits for the one before it and the
output stays independent of how chunks are spread over workers and nodes. The cost is one instance
per chunk and split that may end short (one per `--docs-per-chunk` documents, 256 by default);
fairseq, which RoBERTa trained with, likewise packs each data shard on its own. The short pieces of
over-long sentences that packing drops (data_prep/instances.py: `packed_instances`) are counted per
chunk in a small JSON beside the chunk's parts, which the manifest sums per length and split.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data_prep.atomic_io import atomic_write_json
from data_prep.config import FULL_SENTENCES, NSP
from data_prep.corpus import TokenCorpus, token_part_path
from data_prep.instances import (
    Instance,
    MaskedInstance,
    Packed,
    SpecialIds,
    instances_from_document,
    mask_instance,
    packed_instances,
)
from data_prep.shards import NO_NEXT_SENTENCE_LABEL, SPLITS, id_type, shard_schema, write_shard_table
from data_prep.vocab import load_vocab


def instance_part_path(out: Path, seq_len: int, chunk: int, split: str) -> Path:
    return out / "work" / "instances" / f"seq{seq_len}" / f"part-{chunk:05d}-{split}.arrow"


def dropped_part_path(out: Path, seq_len: int, chunk: int) -> Path:
    """The packed modes' count of dropped short pieces of one (sequence length, chunk), per split."""
    return out / "work" / "instances" / f"seq{seq_len}" / f"part-{chunk:05d}-dropped.json"


def validation_documents(num_documents: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out documents: a seeded draw per document, at least one when asked."""
    if val_fraction <= 0 or num_documents < 2:
        return np.zeros(num_documents, dtype=bool)
    draws = np.random.default_rng([seed, 0x7A1]).random(num_documents)
    held_out = draws < val_fraction
    if not held_out.any():
        held_out[int(np.argmin(draws))] = True
    return held_out


@dataclass(frozen=True)
class InstanceTask:
    out: Path
    num_chunks: int
    chunk: int
    seq_len: int
    seed: int
    short_seq_prob: float
    val_fraction: float
    dupe_factor: int
    static_masking: bool
    mask_prob: float
    max_predictions: int
    whole_word: bool
    segments: str


@functools.lru_cache(maxsize=1)
def _corpus(out: Path, num_chunks: int) -> TokenCorpus:
    return TokenCorpus([token_part_path(out, c) for c in range(num_chunks)])


@functools.lru_cache(maxsize=1)
def _splits(num_documents: int, val_fraction: float, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    held_out = validation_documents(num_documents, val_fraction, seed)
    return held_out, {"train": np.flatnonzero(~held_out), "val": np.flatnonzero(held_out)}


def next_sentence_label(inst: Instance) -> int:
    """The shard's `next_sentence_label`: 1 random next, 0 is next, NO_NEXT_SENTENCE_LABEL none."""
    if inst.is_random_next is None:
        return NO_NEXT_SENTENCE_LABEL
    return 1 if inst.is_random_next else 0


def _columns(rows: list[Instance | tuple[Instance, MaskedInstance]], vocab_size: int, static: bool) -> pa.Table:
    schema = shard_schema(vocab_size, static)
    ids_type = id_type(vocab_size)
    if static:
        plain = [row[0] for row in rows]  # type: ignore[index]
        masked = [row[1] for row in rows]  # type: ignore[index]
        input_ids = [m.input_ids for m in masked]
    else:
        plain = rows  # type: ignore[assignment]
        input_ids = [inst.input_ids for inst in plain]
    columns = [
        pa.array(input_ids, type=pa.list_(ids_type)),
        pa.array([inst.a_len for inst in plain], type=pa.uint16()),
        pa.array([next_sentence_label(inst) for inst in plain], type=pa.int8()),
    ]
    if static:
        columns.append(pa.array([m.masked_positions for m in masked], type=pa.list_(pa.uint16())))
        columns.append(pa.array([m.masked_label_ids for m in masked], type=pa.list_(ids_type)))
    return pa.Table.from_arrays(columns, schema=schema)


# Instances held as Python objects before they become Arrow columns (~40 bytes per token as lists of
# ints; 8,192 instances at 512 are ~170 MB). A chunk counts documents, not tokens, so without a bound
# 256 books would be ~1 GB in one worker.
BATCH_ROWS = 8192


class _RowBatches:
    """One split's instances, converted to Arrow every BATCH_ROWS rows. The written file is one record
    batch of the same rows whatever the batching (write_shard_table combines the chunks), so its bytes
    do not depend on BATCH_ROWS."""

    def __init__(self, vocab_size: int, static: bool) -> None:
        self._vocab_size = vocab_size
        self._static = static
        self._pending: list[Instance | tuple[Instance, MaskedInstance]] = []
        self._tables: list[pa.Table] = []

    def append(self, row: Instance | tuple[Instance, MaskedInstance]) -> None:
        self._pending.append(row)
        if len(self._pending) >= BATCH_ROWS:
            self._convert()

    def _convert(self) -> None:
        self._tables.append(_columns(self._pending, self._vocab_size, self._static))
        self._pending = []

    def table(self) -> pa.Table:
        if self._pending or not self._tables:
            self._convert()
        return pa.concat_tables(self._tables)


def make_instances(task: InstanceTask) -> dict[str, int]:
    """All instances whose first tokens come from this chunk's documents, split by document."""
    vocab = load_vocab(task.out / "vocab.txt")
    ids = vocab.special_ids
    special = SpecialIds(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[PAD]"], ids["[UNK]"])
    continuation = vocab.continuation_mask() if task.whole_word else None
    corpus = _corpus(task.out, task.num_chunks)
    held_out, split_docs = _splits(len(corpus), task.val_fraction, task.seed)
    rng = random.Random(f"instances:{task.seed}:{task.seq_len}:{task.chunk}")
    rows = {split: _RowBatches(vocab.size, task.static_masking) for split in SPLITS}
    if task.segments == NSP:
        made = _nsp_instances(task, corpus, held_out, split_docs, special, rng)
    else:
        packed = _pack_splits(task, corpus, held_out, special, vocab.continuation_mask())
        atomic_write_json(dropped_part_path(task.out, task.seq_len, task.chunk), {
            split: {"pieces": p.dropped_pieces, "tokens": p.dropped_tokens} for split, p in packed.items()
        })  # before the parts: the train part's presence marks the chunk as done
        made = _packed_rounds(packed, task.dupe_factor)
    # Each instance is masked as soon as it is made, so the rng serves both in one fixed order.
    for split, inst in made:
        if task.static_masking:
            masked = mask_instance(
                inst.input_ids, task.mask_prob, task.max_predictions, special, vocab.size, rng, continuation
            )
            rows[split].append((inst, masked))
        else:
            rows[split].append(inst)
    stats: dict[str, int] = {}
    # val first, train last: the train file's presence marks the chunk as done.
    for split in ("val", "train"):
        table = rows[split].table()
        write_shard_table(instance_part_path(task.out, task.seq_len, task.chunk, split), table)
        stats[f"{split}_instances"] = table.num_rows
    return stats


def _nsp_instances(
    task: InstanceTask, corpus: TokenCorpus, held_out: np.ndarray, split_docs: dict[str, np.ndarray],
    special: SpecialIds, rng: random.Random,
) -> Iterator[tuple[str, Instance]]:
    """BERT's pairs, document by document, `dupe_factor` rounds; random next from the same split."""
    for _round in range(task.dupe_factor):
        for doc in corpus.part_range(task.chunk):
            split = "val" if held_out[doc] else "train"
            pool = split_docs[split]
            created = instances_from_document(
                doc,
                corpus.document,
                lambda r, pool=pool: int(pool[r.randrange(len(pool))]),
                task.seq_len,
                task.short_seq_prob,
                special,
                rng,
            )
            for inst in created:
                yield split, inst


def _pack_splits(
    task: InstanceTask, corpus: TokenCorpus, held_out: np.ndarray, special: SpecialIds, continuation: np.ndarray
) -> dict[str, Packed]:
    """The chunk's documents of each split packed in order (cut at word starts: `continuation`)."""
    return {
        split: packed_instances(
            (corpus.document(doc) for doc in corpus.part_range(task.chunk) if held_out[doc] == (split == "val")),
            task.seq_len,
            task.segments == FULL_SENTENCES,
            special,
            continuation,
        )
        for split in SPLITS
    }


def _packed_rounds(packed: dict[str, Packed], dupe_factor: int) -> Iterator[tuple[str, Instance]]:
    """The packing draws nothing, so the `dupe_factor` rounds repeat the same instances: only static
    masking differs between them."""
    for _round in range(dupe_factor):
        for split in SPLITS:
            for inst in packed[split].instances:
                yield split, inst


def instance_chunk_done(out: Path, seq_len: int, chunk: int, packed: bool = False) -> bool:
    """Both parts written, and in a packed mode the count of dropped pieces too (a folder that an
    older build left without it makes its instances again, with today's rule)."""
    parts = all(instance_part_path(out, seq_len, chunk, split).is_file() for split in SPLITS)
    return parts and (not packed or dropped_part_path(out, seq_len, chunk).is_file())


def dropped_pieces(out: Path, seq_len: int, split: str, num_chunks: int) -> dict[str, int]:
    """The manifest's count of one (sequence length, split) in a packed mode: short pieces of over-long
    sentences that no sentence joined, and their tokens, over all chunks (once, whatever `dupe_factor`)."""
    counts = [json.loads(dropped_part_path(out, seq_len, c).read_text(encoding="utf-8"))[split]
              for c in range(num_chunks)]
    return {"pieces_dropped_short": sum(c["pieces"] for c in counts),
            "tokens_dropped_short": sum(c["tokens"] for c in counts)}
