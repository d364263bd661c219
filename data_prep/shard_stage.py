"""Stage 3: instance parts -> globally shuffled shards of equal size (+-1).

A seeded permutation of all instances of one (sequence length, split) is cut into
`num_shards` nearly equal slices (np.array_split), so every rank reads the same number of
instances; shard k is a pure function of (seed, seq_len, split, k, instance parts).
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


@functools.lru_cache(maxsize=1)
def _all_instances(out: Path, seq_len: int, split: str, num_chunks: int) -> pa.Table:
    tables = [read_table(instance_part_path(out, seq_len, c, split)) for c in range(num_chunks)]
    return pa.concat_tables(tables)


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


def write_one_shard(task: ShardTask) -> dict[str, object]:
    path = task.out / shard_file(task.seq_len, task.split, task.index)
    table = _all_instances(task.out, task.seq_len, task.split, task.num_chunks).take(pa.array(task.rows))
    count, digest = write_shard_table(path, table)
    return {"file": shard_file(task.seq_len, task.split, task.index), "num_instances": count, "sha256": digest}


def count_instances(out: Path, seq_len: int, split: str, num_chunks: int) -> tuple[int, int]:
    """(instances, of which random-next) of one (seq_len, split), read from the instance parts.
    Counted as labels equal to 1, so MLM-only instances (NO_NEXT_SENTENCE_LABEL) count as none."""
    table = _all_instances(out, seq_len, split, num_chunks)
    random_next = pc.sum(pc.equal(table.column("next_sentence_label"), 1)).as_py() or 0
    return table.num_rows, int(random_next)
