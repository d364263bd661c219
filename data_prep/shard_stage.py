"""Stage 3: instance parts -> globally shuffled shards of equal size (+-1).

A seeded permutation of all instances of one (sequence length, split) is cut into
`num_shards` nearly equal slices (np.array_split's boundaries), so every rank reads the same number
of instances; shard k is a pure function of (seed, seq_len, split, k, instance parts).

The permutation is a bucketed shuffle (`bucket_orders`), produced lazily, so that the main process
holds about one bucket of it (BUCKET_INSTANCES: 128 MB of int64), never the whole (length, split):
one permutation of 10^9 instances would be 8 GB. Up to BUCKET_INSTANCES instances it is one bucket,
and the order is exactly the single permutation every earlier build drew.

Memory: a shard task holds one shard, never the whole (length, split). Its rows are gathered part
by part (`gather_rows`): each instance part is memory-mapped only while its own rows are taken, and
the shard's order is restored at the end. A `take` over the concatenation of every part would make
Arrow concatenate the whole `input_ids` column first (~3.6 bytes per corpus token per worker, more
with the allocator's retention). The row order, and so every byte, is the same.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data_prep.instance_stage import instance_marker
from data_prep.keyed_order import BUCKET_INSTANCES, SPLIT_SEED, num_buckets, split_key
from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.shard_format.keyed_hash import splitmix_outputs
from data_prep.shard_format.shards import read_table
from data_prep.work_layout import instances_path, shard_file, shard_order_path

HASH_BLOCK = 1 << 15  # indices hashed at a time (256 KB an array); below 2^16: offsets in it fit a uint16
# The bucket hash's key is drawn from (seed, seq_len, split, _HASH_TAG), bucket b's shuffle from
# (seed, seq_len, split, b): b stays far below the tag (it would take 1.7e9 buckets).
_HASH_TAG = 0x68617368  # "hash"


@functools.lru_cache(maxsize=4)
def part_starts(out: Path, seq_len: int, split: str, num_shards: int) -> np.ndarray:
    """Global index of each input shard's first instance (and the total last): num_shards + 1 integers,
    from the instance tasks' markers."""
    counts = [instance_marker(out, seq_len, s)[f"{split}_instances"] for s in range(num_shards)]
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def bucket_ids(indices: np.ndarray, key: np.uint64, buckets: int) -> np.ndarray:
    """Bucket of each instance index (uint64 array): splitmix64's output number i+1 from state `key`,
    mod `buckets`. A keyed hash, not a generator's stream, so that any block of indices can be
    recomputed alone, the same every time (the modulo's bias is below buckets / 2^64)."""
    return splitmix_outputs(indices, key) % np.uint64(buckets)


def bucket_members(num_instances: int, key: np.uint64, buckets: int, bucket: int) -> np.ndarray:
    """The instance indices (ascending, int64) that hash to `bucket`, found by hashing every index in
    blocks of HASH_BLOCK, so nothing of the corpus' size is held: main pays N hashes per bucket (about
    10 ns each), overlapped with the workers writing the shards already planned. Each block's members
    are kept as 2-byte offsets until the bucket's size is known, so collecting a bucket costs a
    quarter of it on top of the bucket itself (int64 pieces and a concatenation would cost twice)."""
    offsets = []
    for first in range(0, num_instances, HASH_BLOCK):
        indices = np.arange(first, min(first + HASH_BLOCK, num_instances), dtype=np.uint64)
        offsets.append(np.flatnonzero(bucket_ids(indices, key, buckets) == bucket).astype(np.uint16))
    members = np.empty(sum(len(o) for o in offsets), np.int64)
    at = 0
    for block, local in enumerate(offsets):
        members[at : at + len(local)] = local
        members[at : at + len(local)] += block * HASH_BLOCK
        at += len(local)
    return members


def bucket_orders(
    num_instances: int, seed: int, seq_len: int, split: str, bucket_instances: int = BUCKET_INSTANCES
) -> Iterator[np.ndarray]:
    """The global order of the instances of (seq_len, split), one bucket at a time.

    B = ceil(N / bucket_instances) buckets. Instance i goes to bucket hash(seed, seq_len, split, i) mod B
    (iid uniform, as far as the hash is), each bucket's members are shuffled by a generator seeded
    with (seed, seq_len, split, bucket), and the order is bucket 0's, then bucket 1's, ... This is an
    exactly uniform permutation: for each vector of bucket sizes (n_1..n_B), a given order of the N
    instances arises from exactly one assignment (its first n_1 instances in bucket 0, the next n_2 in
    bucket 1, ...; probability B^-N) and one shuffle of each bucket (prod_b 1/n_b!), so
    P(order) = sum over size vectors of B^-N * prod_b 1/n_b! = B^-N * (sum of the multinomials
    N! / prod_b n_b!) / N! = B^-N * B^N / N! = 1/N!.

    With B = 1 it is `default_rng([seed, seq_len, SPLIT_SEED[split]]).permutation(N)`, the order
    of every build before buckets, so a corpus up to bucket_instances keeps its bytes.
    """
    buckets = num_buckets(num_instances, bucket_instances)
    if buckets == 1:
        yield bucket_shuffle(seed, seq_len, split, None).permutation(num_instances)
        return
    key = bucket_key(seed, seq_len, split)
    for bucket in range(buckets):
        members = bucket_members(num_instances, key, buckets, bucket)
        bucket_shuffle(seed, seq_len, split, bucket).shuffle(members)  # permutation(members), in place
        yield members
        del members  # before the next bucket is collected


def bucket_key(seed: int, seq_len: int, split: str) -> np.uint64:
    """The key of the instance -> bucket hash of one (length, split)."""
    return split_key(seed, seq_len, split, _HASH_TAG)


def bucket_shuffle(seed: int, seq_len: int, split: str, bucket: int | None) -> np.random.Generator:
    """The generator that shuffles one bucket (None: the single bucket of a (length, split) up to
    BUCKET_INSTANCES, seeded as every build before buckets). `permutation(n)` applies exactly the swaps
    that `shuffle` applies to n members, so a bucket's order can be drawn without its members."""
    entropy = [seed, seq_len, SPLIT_SEED[split]]
    return np.random.default_rng(entropy if bucket is None else [*entropy, bucket])


def shard_ends(num_instances: int, num_shards: int) -> list[int]:
    """End position of each shard in the global order: np.array_split's boundaries (the first
    N mod num_shards shards one longer)."""
    each, extra = divmod(num_instances, num_shards)
    return [(k + 1) * each + min(k + 1, extra) for k in range(num_shards)]


def shard_plan(
    num_instances: int, num_shards: int, seed: int, seq_len: int, split: str,
    bucket_instances: int = BUCKET_INSTANCES,
) -> Iterator[np.ndarray]:
    """Each shard's rows (global instance indices, in the shard's order), shard 0 first, made as they
    are asked for: shard k is positions [start_k, end_k) of `bucket_orders`, and may span two buckets
    (or more, with more shards than buckets hold). Main holds the bucket being cut, the shard being
    filled, and the shards the caller still holds."""
    ends = shard_ends(num_instances, num_shards)
    pieces: list[np.ndarray] = []
    shard = filled = 0
    for order in bucket_orders(num_instances, seed, seq_len, split, bucket_instances):
        at = 0
        while True:
            while shard < num_shards and ends[shard] == filled:
                yield np.concatenate(pieces) if pieces else np.empty(0, np.int64)
                pieces, shard = [], shard + 1
            if at == len(order):
                break
            take = min(len(order) - at, ends[shard] - filled)
            pieces.append(order[at : at + take].copy())  # a view would keep the whole bucket alive
            at, filled = at + take, filled + take
        del order


def order_bucket(out: Path, seq_len: int, split: str, num_instances: int,
                 bucket_instances: int = BUCKET_INSTANCES) -> int:
    """The bucket size the shards of (seq_len, split) in `out` are cut with: `bucket_instances`, except
    in a folder whose shard stage the code before buckets began. Up to one bucket the order is that
    code's anyway. Over it, the size is recorded in work/ before the first shard is written, so shards
    found without the record were cut from that code's single permutation: the rest are cut from it
    too (its 8 bytes per instance in main), and a resumed folder never mixes two orders (which would
    repeat some instances and lose others)."""
    record = shard_order_path(out, seq_len, split)
    if record.is_file():  # first: a folder's shards are cut with the size it recorded (tests record small ones)
        return int(json.loads(record.read_text(encoding="utf-8"))["bucket_instances"])
    if num_instances <= bucket_instances:
        return bucket_instances
    if any((out / shard_file(seq_len, split, 0)).parent.glob(f"{split}-*.arrow")):
        print(f"seq {seq_len} {split}: resuming shards cut before the bucketed shuffle; finishing them "
              "with the one permutation they were cut from", flush=True)
        return num_instances
    atomic_write_json(record, {"bucket_instances": bucket_instances})
    return bucket_instances


@dataclass(frozen=True)
class ShardTask:
    out: Path
    seq_len: int
    split: str
    num_shards: int  # input shards: instance files to gather from
    index: int
    rows: np.ndarray


def parts_of_rows(starts: np.ndarray, rows: np.ndarray) -> dict[int, np.ndarray]:
    """Which instance parts hold `rows` (global indices, sorted): part -> its rows, as local indices."""
    part_of = np.searchsorted(starts, rows, side="right") - 1
    parts, firsts = np.unique(part_of, return_index=True)
    bounds = [*firsts.tolist(), len(rows)]
    return {int(p): rows[bounds[i] : bounds[i + 1]] - starts[p] for i, p in enumerate(parts)}


def take_in_order(rows: np.ndarray, starts: np.ndarray, read_part: Callable[[int], pa.Table]) -> pa.Table:
    """The rows at `rows` (indices over parts that begin at `starts`), in that order: sorted, taken from only the
    parts they fall in (each read once, by `read_part`), then put back in the given order."""
    order = np.argsort(rows, kind="stable")
    pieces = [read_part(part).take(pa.array(local)) for part, local in parts_of_rows(starts, rows[order]).items()]
    in_sorted_order = pa.concat_tables(pieces).combine_chunks()
    del pieces
    restore = np.empty_like(order)
    restore[order] = np.arange(len(order))
    return in_sorted_order.take(pa.array(restore))


def gather_rows(task: ShardTask) -> pa.Table:
    """The instances at `task.rows`, in that order, read from only the input shards' files they fall in."""
    starts = part_starts(task.out, task.seq_len, task.split, task.num_shards)
    return take_in_order(task.rows, starts,
                         lambda part: read_table(instances_path(task.out, task.seq_len, part, task.split)))


def count_instances(out: Path, seq_len: int, split: str, num_shards: int) -> tuple[int, int]:
    """(instances, of which random-next) of one (seq_len, split), from the instance tasks' markers."""
    markers = [instance_marker(out, seq_len, s) for s in range(num_shards)]
    return sum(m[f"{split}_instances"] for m in markers), sum(m[f"{split}_random_next"] for m in markers)


def dropped_pieces(out: Path, seq_len: int, split: str, num_shards: int) -> dict[str, int]:
    """The manifest's count of one (sequence length, split) in a packed mode: short pieces of over-long
    sentences that no sentence joined, and their tokens, over all shards (once, whatever `dupe_factor`)."""
    counts = [instance_marker(out, seq_len, s)["dropped"][split] for s in range(num_shards)]
    return {"pieces_dropped_short": sum(c["pieces"] for c in counts),
            "tokens_dropped_short": sum(c["tokens"] for c in counts)}
