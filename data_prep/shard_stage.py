"""Stage 3: instance parts -> globally shuffled shards of equal size (+-1).

A seeded permutation of all instances of one (sequence length, split) is cut into
`num_shards` nearly equal slices (np.array_split), so every rank reads the same number of
instances; shard k is a pure function of (seed, seq_len, split, k, instance parts).

Memory: a shard task holds one shard, never the whole (length, split). Its rows are gathered part
by part (`gather_rows`): each instance part is memory-mapped only while its own rows are taken, and
the shard's order is restored at the end. A `take` over the concatenation of every part would make
Arrow concatenate the whole `input_ids` column first (~3.6 bytes per corpus token per worker, more
with the allocator's retention). The row order, and so every byte, is the same.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data_prep.instance_stage import instance_part_path
from data_prep.shards import read_table, write_shard_table

SPLIT_SEED = {"train": 0, "val": 1}


def shard_file(seq_len: int, split: str, index: int) -> str:
    return f"seq{seq_len}/{split}-{index:05d}.arrow"


@functools.lru_cache(maxsize=4)
def part_starts(out: Path, seq_len: int, split: str, num_chunks: int) -> np.ndarray:
    """Global index of each instance part's first row (and the total last): num_chunks + 1 integers.
    Reading a row count touches only the part's Arrow footer and batch header."""
    counts = [read_table(instance_part_path(out, seq_len, c, split)).num_rows for c in range(num_chunks)]
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def shard_plan(num_instances: int, num_shards: int, seed: int, seq_len: int, split: str) -> list[np.ndarray]:
    order = np.random.default_rng([seed, seq_len, SPLIT_SEED[split]]).permutation(num_instances)
    return np.array_split(order, num_shards)


@dataclass(frozen=True)
class ShardTask:
    out: Path
    seq_len: int
    split: str
    num_chunks: int
    index: int
    rows: np.ndarray


def parts_of_rows(starts: np.ndarray, rows: np.ndarray) -> dict[int, np.ndarray]:
    """Which instance parts hold `rows` (global indices, sorted): part -> its rows, as local indices."""
    part_of = np.searchsorted(starts, rows, side="right") - 1
    parts, firsts = np.unique(part_of, return_index=True)
    bounds = [*firsts.tolist(), len(rows)]
    return {int(p): rows[bounds[i] : bounds[i + 1]] - starts[p] for i, p in enumerate(parts)}


def gather_rows(task: ShardTask) -> pa.Table:
    """The instances at `task.rows`, in that order, read from only the parts they fall in."""
    starts = part_starts(task.out, task.seq_len, task.split, task.num_chunks)
    order = np.argsort(task.rows, kind="stable")
    pieces = [
        read_table(instance_part_path(task.out, task.seq_len, part, task.split)).take(pa.array(local))
        for part, local in parts_of_rows(starts, task.rows[order]).items()
    ]
    in_sorted_order = pa.concat_tables(pieces).combine_chunks()
    del pieces
    restore = np.empty_like(order)
    restore[order] = np.arange(len(order))
    return in_sorted_order.take(pa.array(restore))


def write_one_shard(task: ShardTask) -> dict[str, object]:
    path = task.out / shard_file(task.seq_len, task.split, task.index)
    count, digest = write_shard_table(path, gather_rows(task))
    return {"file": shard_file(task.seq_len, task.split, task.index), "num_instances": count, "sha256": digest}


def count_instances(out: Path, seq_len: int, split: str, num_chunks: int) -> tuple[int, int]:
    """(instances, of which random-next) of one (seq_len, split), read from the instance parts one at a
    time. Counted as labels equal to 1, so MLM-only instances (NO_NEXT_SENTENCE_LABEL) count as none."""
    count = random_next = 0
    for chunk in range(num_chunks):
        table = read_table(instance_part_path(out, seq_len, chunk, split))
        count += table.num_rows
        random_next += pc.sum(pc.equal(table.column("next_sentence_label"), 1)).as_py() or 0
    return count, int(random_next)
