"""The shuffle of a (length, split) over one bucket, as tasks with bounded memory and linear work.

The order is `shard_stage.bucket_orders`: instance g goes to bucket hash(g) mod B, each bucket is shuffled by
its own generator, the buckets follow one another, and output shard k is the k-th `np.array_split` slice. Over
one bucket (BUCKET_INSTANCES), it is made in two steps instead of in the main process:

* scatter, one task per (input shard, length): the shard's instances of each such split, hashed by global index
  and stably grouped by bucket into work/buckets/ (record batch b = bucket b, in ascending global index), with
  the bucket sizes in the task's marker. Each instance is hashed once: linear in the corpus.
* gather, one task per output shard: the positions it covers in the order of the bucket(s) it spans; a
  bucket's order is drawn without its members (`permutation(n_b)` is the swaps `shuffle` applies to them), and
  member j of bucket b is row j - (members before in earlier input shards) of that shard's batch b. The rows
  are read from the batches of the bucket only (contiguous, mapped), sorted, then put in the shard's order.

Main holds the bucket sizes (input shards x buckets integers), nothing of the order; a gather task holds one
bucket's permutation (8 bytes per member: 128 MiB at 2^24) and its shard's rows.

The keyed order (data_prep/keyed_order.py) has no scatter: the instance files are grouped by bucket when they
are made, the bucket sizes are in the instance markers (`keyed_sizes`), and the gather is the same but for where
bucket b's rows of an input shard are read (`BucketedShardTask.keyed`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data_prep.batch_files import AtomicBatchWriter, read_batches
from data_prep.instance_stage import instance_marker
from data_prep.keyed_order import bucket_table, keyed_bucket_ids, keyed_key
from data_prep.shard_format.shards import read_table
from data_prep.shard_stage import bucket_ids, bucket_key, bucket_shuffle, part_starts, take_in_order
from data_prep.task_markers import write_marker
from data_prep.work_layout import instances_path, marker_path, scatter_stage, scattered_path


@dataclass(frozen=True)
class ScatterTask:
    out: Path
    num_shards: int
    shard: int
    seq_len: int
    seed: int
    buckets: tuple[tuple[str, int], ...]  # (split, B) of the splits cut over one bucket


def scatter_done(out: Path, seq_len: int, shard: int) -> bool:
    return marker_path(out, scatter_stage(seq_len), shard).is_file()


def scatter(task: ScatterTask) -> None:
    """One input shard's instances, grouped by bucket, per split; then the marker with the bucket sizes."""
    sizes: dict[str, list[int]] = {}
    for split, buckets in task.buckets:
        first = int(part_starts(task.out, task.seq_len, split, task.num_shards)[task.shard])
        table = read_table(instances_path(task.out, task.seq_len, task.shard, split))
        indices = np.arange(first, first + table.num_rows, dtype=np.uint64)
        ids = bucket_ids(indices, bucket_key(task.seed, task.seq_len, split), buckets)
        del indices
        order = np.argsort(ids, kind="stable")  # within a bucket: ascending global index
        per_bucket = np.bincount(ids.astype(np.int64), minlength=buckets)
        del ids
        with AtomicBatchWriter(scattered_path(task.out, task.seq_len, task.shard, split), table.schema) as writer:
            at = 0
            for count in per_bucket.tolist():
                writer.write(table.take(pa.array(order[at : at + count])))
                at += count
        sizes[split] = per_bucket.tolist()
    written = [scattered_path(task.out, task.seq_len, task.shard, split) for split in sizes]
    write_marker(task.out, marker_path(task.out, scatter_stage(task.seq_len), task.shard), sizes, written)


def bucket_sizes(out: Path, seq_len: int, split: str, num_shards: int) -> np.ndarray:
    """Members of each bucket in each input shard: an input shards x buckets array, from the scatter markers."""
    return np.array([json.loads(marker_path(out, scatter_stage(seq_len), s).read_text(encoding="utf-8"))[split]
                     for s in range(num_shards)], dtype=np.int64)


def keyed_sizes(out: Path, seq_len: int, split: str, num_shards: int) -> np.ndarray:
    """The same, in the keyed order: from the instance markers, which record each bucket's rows."""
    return np.array([instance_marker(out, seq_len, s)[f"{split}_buckets"] for s in range(num_shards)],
                    dtype=np.int64)


def keyed_orders(counts: Sequence[int], seed: int, seq_len: int, split: str, buckets: int) -> Iterator[np.ndarray]:
    """The keyed order computed whole, bucket by bucket (global indices; `counts`: each input shard's instances):
    bucket b's members in ascending global index, which is (input shard, index) order, shuffled by bucket b's
    generator. What the gathers cut without holding it (they draw `permutation(n_b)`, the same swaps); it holds
    every instance's bucket (8 bytes each), so it is for checks and tests."""
    key = keyed_key(seed, seq_len, split)
    ids = np.concatenate([np.empty(0, np.uint64), *(keyed_bucket_ids(s, np.arange(n, dtype=np.uint64), key, buckets)
                                                    for s, n in enumerate(counts))])
    for bucket in range(buckets):
        members = np.flatnonzero(ids == np.uint64(bucket))
        bucket_shuffle(seed, seq_len, split, bucket).shuffle(members)
        yield members


@dataclass(frozen=True)
class BucketedShardTask:
    out: Path
    seq_len: int
    split: str
    seed: int
    index: int
    start: int  # positions [start, end) of the order
    end: int
    sizes: np.ndarray  # bucket_sizes(), or keyed_sizes() in the keyed order
    keyed: bool = False  # the keyed order: bucket b is read from the instance files, grouped when made

    @property
    def rows(self) -> range:  # what the manifest counts
        return range(self.start, self.end)


def gather_bucketed(task: BucketedShardTask) -> pa.Table:
    """The instances at positions [start, end) of the order, read bucket by bucket from the scattered files."""
    totals = task.sizes.sum(axis=0)
    bucket_starts = np.concatenate([[0], np.cumsum(totals)])
    pieces: list[pa.Table] = []
    for bucket in range(len(totals)):
        lo, hi = max(task.start, bucket_starts[bucket]), min(task.end, bucket_starts[bucket + 1])
        if lo >= hi:
            continue
        order = bucket_shuffle(task.seed, task.seq_len, task.split, bucket).permutation(int(totals[bucket]))
        members = order[lo - bucket_starts[bucket] : hi - bucket_starts[bucket]].copy()
        del order
        pieces.append(_take_members(task, bucket, members))
    return pa.concat_tables(pieces).combine_chunks()


def _take_members(task: BucketedShardTask, bucket: int, members: np.ndarray) -> pa.Table:
    """Members (indices into bucket `bucket`'s ascending members) in the given order, from that bucket's batch
    of each input shard's scattered file (keyed: its batches in each input shard's instance file)."""
    shard_starts = np.concatenate([[0], np.cumsum(task.sizes[:, bucket])])
    if task.keyed:
        buckets = task.sizes.shape[1]
        return take_in_order(members, shard_starts, lambda shard: bucket_table(
            instances_path(task.out, task.seq_len, shard, task.split), bucket, buckets))
    return take_in_order(members, shard_starts, lambda shard: pa.Table.from_batches(
        [read_batches(scattered_path(task.out, task.seq_len, shard, task.split)).get_batch(bucket)]))
