"""The keyed shuffle order: instance tasks write their instances already grouped by shuffle bucket.

The first bucketed order (data_prep/shard_stage.py: `bucket_orders`) puts instance g of a (length, split) in
bucket hash(g) mod B with B = ceil(N / BUCKET_INSTANCES): both need every instance task done (g counts the
instances of every earlier input shard, N all of them), so a scatter pass had to copy every instance into its
bucket once they were all made. The keyed order fixes both before any instance exists:

* B from the corpus stage's totals (tokens and documents, in its markers): `estimate_instances`, an
  over-estimate of a split's instances, over BUCKET_INSTANCES;
* the bucket of the i-th instance of input shard s: a keyed hash of (s, i), `keyed_bucket_ids`.

So an instance task writes its file grouped by bucket as it makes the instances (`BucketGroupedWriter`: runs of
B record batches, batch r * B + b holding bucket b's rows of run r), its marker records each bucket's rows, and a
gather reads each bucket's batches directly: no scatter, no work/buckets/. Within a bucket the members are in
(input shard, index) order, which is the global index order, and bucket b is then shuffled as before, so the
order is uniform for the same reason (`bucket_orders`' proof holds for any B and any iid uniform bucket draw).

Versioned: the order is recorded per (length, split) in work/shards/ (`keyed_buckets`) before the first instance
file of its length, as {"order": "keyed", "bucket_instances", "buckets"}. A record without "order" (the first
bucketed order, written at the shard stage) or instance markers already there without a record (a folder whose
instance stage an earlier version began) keep the scatter order. Under one bucket nothing is recorded and the
shards are the single permutation of every earlier build.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from data_prep.batch_files import AtomicBatchWriter, read_batches
from data_prep.corpus_index import CorpusIndex, count_held_out
from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.shard_format.keyed_hash import splitmix_outputs
from data_prep.work_layout import instances_stage, marker_path, shard_order_path

ORDER_KEYED = "keyed"  # the order's version, in its record
SPLIT_SEED = {"train": 0, "val": 1}
# Instances per shuffle bucket: the order a gather draws at a time, 128 MB of int64. Changing it changes the
# shards of every (length, split) over it, so it is a constant, not an option.
BUCKET_INSTANCES = 1 << 24
_KEYED_TAG = 0x6B657964  # "keyd": the keyed hash's key, apart from the first order's and the buckets' shuffles
# Rows of a split held before a run of B batches is written (Arrow bytes): bounds an instance task's memory,
# whatever B; no shard byte depends on it (a shard is written as one record batch of its rows).
RUN_BYTES = 64 << 20


def num_buckets(num_instances: int, bucket_instances: int) -> int:
    return max(1, -(-num_instances // bucket_instances))


def split_key(seed: int, seq_len: int, split: str, tag: int) -> np.uint64:
    """A 64-bit hash key of one (length, split), apart for each use (`tag`): this order's and the first
    bucketed order's (data_prep/shard_stage.py `bucket_key`)."""
    return np.random.SeedSequence([seed, seq_len, SPLIT_SEED[split], tag]).generate_state(1, np.uint64)[0]


def keyed_key(seed: int, seq_len: int, split: str) -> np.uint64:
    """The key of the (input shard, index) -> bucket hash of one (length, split)."""
    return split_key(seed, seq_len, split, _KEYED_TAG)


def keyed_bucket_ids(shard: int, local: np.ndarray, key: np.uint64, buckets: int) -> np.ndarray:
    """Bucket of instances `local` (uint64 indices within input shard `shard`): splitmix64's output number i+1
    from the shard's own state, itself output number shard+1 from `key`. Any instance's bucket is computed
    alone, the same in every process (the modulo's bias is below buckets / 2^64)."""
    shard_state = splitmix_outputs(np.array([shard], np.uint64), key)
    return splitmix_outputs(local, shard_state) % np.uint64(buckets)


def estimate_instances(tokens: int, documents: int, seq_len: int, dupe_factor: int) -> int:
    """An over-estimate of the instances a split of `tokens` tokens in `documents` documents gives at `seq_len`:
    an instance takes about its target length of tokens (3/4 of it on average where its B is a random next,
    less where `short_seq_prob` drew a short target), so half of (seq_len - 3) tokens each, plus one per
    document (its last, short one), per `dupe_factor` round. Only B follows from it: a low estimate makes larger
    buckets, a high one smaller ones, never other rows."""
    per_instance = max(1, (seq_len - 3) // 2)
    return dupe_factor * (math.ceil(tokens / per_instance) + documents)


def split_estimate(index: CorpusIndex, split: str, seq_len: int, dupe_factor: int, val_fraction: float,
                   seed: int) -> int:
    """`estimate_instances` of a split from the corpus stage's totals: train, the corpus less the held-out
    documents (its tokens bounded by the corpus'); val, the held-out documents and four times their share of
    the tokens (a held-out document is drawn whatever its size)."""
    documents = index.documents
    held = count_held_out(documents, val_fraction, seed)
    tokens = int(index.totals.get("tokens", 0))
    if split == "train":
        return estimate_instances(tokens, documents - held, seq_len, dupe_factor)
    share = min(1.0, 4 * held / max(documents, 1))
    return estimate_instances(math.ceil(tokens * share), held, seq_len, dupe_factor)


def read_record(out: Path, seq_len: int, split: str) -> dict | None:
    path = shard_order_path(out, seq_len, split)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def keyed_buckets(out: Path, seq_len: int, split: str, estimate: Callable[[], int]) -> int:
    """The bucket count of the keyed order of (seq_len, split), recorded by the first process that asks (any
    instance task: each computes the same from the corpus stage's markers); 0 where it does not apply: one
    bucket, or a folder begun with the scatter order. The markers are looked at before the record: a task
    writes the record before its marker, so a marker seen means its record is seen too."""
    begun = any(marker_path(out, instances_stage(seq_len), 0).parent.glob(f"{instances_stage(seq_len)}-*.json"))
    record = read_record(out, seq_len, split)
    if record is not None:
        if record.get("order") != ORDER_KEYED:
            return 0  # the scatter order's record
        if "buckets" not in record:  # a bucket size recorded alone (the tests' small buckets): B from it now
            record = {**record, "buckets": num_buckets(estimate(), int(record["bucket_instances"]))}
            atomic_write_json(shard_order_path(out, seq_len, split), record)
        return int(record["buckets"]) if int(record["buckets"]) > 1 else 0
    if begun:
        return 0  # instance files made without a record: by an earlier version, in the scatter order
    buckets = num_buckets(estimate(), BUCKET_INSTANCES)
    if buckets == 1:
        return 0
    atomic_write_json(shard_order_path(out, seq_len, split),
                      {"order": ORDER_KEYED, "bucket_instances": BUCKET_INSTANCES, "buckets": buckets})
    return buckets


def recorded_buckets(out: Path, seq_len: int, split: str) -> int:
    """The keyed order's bucket count of (seq_len, split) as recorded (0: not the keyed order)."""
    record = read_record(out, seq_len, split)
    if record is None or record.get("order") != ORDER_KEYED or int(record.get("buckets", 0)) <= 1:
        return 0
    return int(record["buckets"])


class BucketGroupedWriter:
    """An instance file grouped by bucket as it is written: rows are held per bucket until RUN_BYTES of them,
    then written as a run of exactly `buckets` record batches (batch r * buckets + b: bucket b's rows of run r,
    in the order they came, possibly none). `counts` is each bucket's rows (the marker's). The same interface
    as AtomicBatchWriter: `with ... as writer: writer.write(table)`; the file appears whole or not at all."""

    def __init__(self, path: Path, schema: pa.Schema, shard: int, key: np.uint64, buckets: int) -> None:
        self.path = path
        self._file = AtomicBatchWriter(path, schema)
        self._shard, self._key, self._buckets = shard, key, buckets
        self._pending: list[list[pa.Table]] = [[] for _ in range(buckets)]
        self._pending_bytes = 0
        self._runs = 0
        self.counts = np.zeros(buckets, np.int64)
        self.rows = 0

    def __enter__(self) -> BucketGroupedWriter:
        self._file.__enter__()
        return self

    def write(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        local = np.arange(self.rows, self.rows + table.num_rows, dtype=np.uint64)
        ids = keyed_bucket_ids(self._shard, local, self._key, self._buckets).astype(np.int64)
        order = np.argsort(ids, kind="stable")  # within a bucket: the order they were made in
        per_bucket = np.bincount(ids, minlength=self._buckets)
        grouped = table.take(pa.array(order))
        at = 0
        for bucket in np.flatnonzero(per_bucket).tolist():
            count = int(per_bucket[bucket])
            self._pending[bucket].append(grouped.slice(at, count))
            at += count
        self.counts += per_bucket
        self.rows += table.num_rows
        self._pending_bytes += grouped.nbytes
        if self._pending_bytes >= RUN_BYTES:
            self._write_run()

    def _write_run(self) -> None:
        for bucket in range(self._buckets):
            pieces = self._pending[bucket]
            self._file.write(pa.concat_tables(pieces) if pieces else self._file.schema.empty_table())
            self._pending[bucket] = []
        self._pending_bytes = 0
        self._runs += 1

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None and (self._runs == 0 or self._pending_bytes):
            self._write_run()
        self._file.__exit__(kind, *rest)


def bucket_table(path: Path, bucket: int, buckets: int) -> pa.Table:
    """Bucket `bucket`'s rows of a file BucketGroupedWriter wrote, in order: batch r * buckets + bucket of each
    run r (mapped, no copy)."""
    reader = read_batches(path)
    runs = reader.num_record_batches // buckets
    return pa.Table.from_batches([reader.get_batch(run * buckets + bucket) for run in range(runs)],
                                 schema=reader.schema)
