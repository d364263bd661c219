"""The shard stage's bucketed shuffle (data_prep/shard_stage.py: bucket_orders, shard_plan).

It replaced one permutation of every instance of a (length, split), drawn in the main process (8 bytes
per instance), by buckets shuffled one at a time. What must hold: one bucket is exactly the old
permutation (so the recorded shards of test_nsp_unchanged.py keep their bytes), the shards still cut a
permutation into np.array_split's sizes, the order is uniform, main's memory follows the bucket and not
the corpus, and a folder whose shards the old code began is finished with the old order. Small bucket
sizes go in through `bucket_instances`, the seam the build passes the constant through.
"""

from __future__ import annotations

import json
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from data_prep.bucket_stage import keyed_orders
from data_prep.keyed_order import ORDER_KEYED, keyed_bucket_ids, keyed_buckets, keyed_key, recorded_buckets
from data_prep.shard_format.shards import read_table
from data_prep.shard_stage import (
    BUCKET_INSTANCES,
    ShardTask,
    bucket_orders,
    gather_rows,
    order_bucket,
    part_starts,
    shard_plan,
)
from tests.data_prep.segment_inputs import build, write_inputs


def plan(num_instances: int, num_shards: int, bucket: int, seed: int = 5, seq_len: int = 128,
         split: str = "train") -> list[np.ndarray]:
    return list(shard_plan(num_instances, num_shards, seed, seq_len, split, bucket_instances=bucket))


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("num_instances", [0, 1, 1000, 1001])
def test_one_bucket_is_the_single_permutation_of_before(num_instances: int, split: str) -> None:
    split_seed = {"train": 0, "val": 1}[split]
    before = np.array_split(np.random.default_rng([5, 128, split_seed]).permutation(num_instances), 3)
    for bucket in (max(num_instances, 1), BUCKET_INSTANCES):
        shards = plan(num_instances, 3, bucket, split=split)
        assert len(shards) == 3
        for got, want in zip(shards, before, strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("bucket", [7, 64])
@pytest.mark.parametrize("num_instances", [1, 5, 64, 1000, 1001])
@pytest.mark.parametrize("num_shards", [1, 3, 8])
def test_shards_cut_a_permutation_into_equal_sizes(num_instances: int, num_shards: int, bucket: int) -> None:
    shards = plan(num_instances, num_shards, bucket)
    assert len(shards) == num_shards
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(num_instances))
    sizes = [len(s) for s in shards]
    assert sizes == [len(s) for s in np.array_split(np.arange(num_instances), num_shards)]
    assert max(sizes) - min(sizes) <= 1
    again = plan(num_instances, num_shards, bucket)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))


def test_the_order_depends_on_seed_length_and_split_and_is_bucketed() -> None:
    order = np.concatenate(plan(1000, 4, 64))
    assert np.concatenate(list(bucket_orders(1000, 5, 128, "train", 64))).tolist() == order.tolist()
    for other in (dict(seed=6), dict(seq_len=512), dict(split="val")):
        assert not np.array_equal(np.concatenate(plan(1000, 4, 64, **other)), order), other
    # 16 buckets, not the one permutation
    assert not np.array_equal(order, np.concatenate(plan(1000, 4, 1000)))
    buckets = list(bucket_orders(1000, 5, 128, "train", 64))
    assert len(buckets) == 16 and all(len(b) > 0 for b in buckets)


def keyed(seed: int) -> np.ndarray:
    """The keyed order of 6 instances, 3 in each of two input shards, in 3 buckets (bucket_stage.keyed_orders)."""
    return np.concatenate(list(keyed_orders([3, 3], seed, 128, "train", 3)))


@pytest.mark.parametrize("order", ["global index hash", "keyed hash of (input shard, index)"])
def test_order_is_uniform_over_fixed_seeds(order: str) -> None:
    """N = 6 in 3 buckets (of 2 on average), 3000 seeds (fixed, so not flaky): every instance is at every
    position about 1/6 of the time, and before any other one half of the time. Both orders: the scatter order's
    bucket from the global index, and the keyed order's from (input shard, index within it)."""
    seeds = range(3000)
    draw = keyed if order.startswith("keyed") else (lambda s: np.concatenate(plan(6, 1, 2, seed=s)))
    orders = np.array([draw(s) for s in seeds])
    counts = np.zeros((6, 6))
    for position in range(6):
        counts[:, position] = np.bincount(orders[:, position], minlength=6)
    expected = len(seeds) / 6
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 70, chi_square  # 25 degrees of freedom: p ~ 1e-5 at 70
    rank = np.argsort(orders, axis=1)  # rank[s, i]: the position of instance i
    for first in range(6):
        for second in range(first + 1, 6):
            before = float((rank[:, first] < rank[:, second]).mean())
            assert abs(before - 0.5) < 0.04, (first, second, before)  # sd 0.009
    sequences = Counter(map(tuple, orders.tolist()))
    assert len(sequences) > 600 and max(sequences.values()) < 20  # 720 orders, 4.2 each on average


def test_keyed_buckets_are_uniform_and_differ_per_shard() -> None:
    """The keyed hash spreads 4 input shards of 20,000 instances evenly over 16 buckets (chi-square, 15 degrees
    of freedom), gives each shard its own sequence, and depends on the key (seed, length, split)."""
    key = keyed_key(5, 128, "train")
    local = np.arange(20_000, dtype=np.uint64)
    ids = [keyed_bucket_ids(shard, local, key, 16) for shard in range(4)]
    counts = np.bincount(np.concatenate(ids).astype(np.int64), minlength=16)
    expected = 80_000 / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 45  # p ~ 1e-4
    assert not np.array_equal(ids[0], ids[1])
    for other in (keyed_key(6, 128, "train"), keyed_key(5, 512, "train"), keyed_key(5, 128, "val")):
        assert not np.array_equal(keyed_bucket_ids(0, local, other, 16), ids[0])
    assert np.array_equal(keyed_bucket_ids(2, local[5:9], key, 16), ids[2][5:9])  # any block alone, the same


def test_main_holds_a_bucket_not_the_corpus() -> None:
    """2,000,000 instances in buckets of 100,000: one permutation would be 16 MB of int64 alone."""
    tracemalloc.start()
    try:
        seen = 0
        for rows in shard_plan(2_000_000, 16, 5, 128, "train", bucket_instances=100_000):
            seen += len(rows)
            del rows
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == 2_000_000
    assert peak < 6 * 2**20, peak


def row_keys(table: pa.Table) -> Counter:
    return Counter(json.dumps(row, sort_keys=True) for row in table.to_pylist())


def test_built_instances_land_in_exactly_one_shard_with_small_buckets(tmp_path: Path) -> None:
    """A real build's instance parts, cut with buckets of 7: the shards hold every instance once,
    the same rows as the build's own shards (one bucket), in another order."""
    corpus = write_inputs(tmp_path / "inputs")
    out = tmp_path / "out"
    flags = ["--workers", "1", "--seq-lens", "48", "--num-shards", "2", "--docs-per-chunk", "16", "--keep-work"]
    assert build(corpus, out, *flags) == 0
    num_shards = len(list((out / "work" / "instances" / "seq48").glob("shard-*-train.arrow")))  # input shards
    built = pa.concat_tables([read_table(out / "seq48" / f"train-{k:05d}.arrow") for k in range(2)])
    count = built.num_rows
    assert count > 3 * 7
    shards = [
        gather_rows(ShardTask(out, 48, "train", num_shards, k, rows))
        for k, rows in enumerate(shard_plan(count, 3, 7, 48, "train", bucket_instances=7))
    ]
    part_starts.cache_clear()
    assert max(s.num_rows for s in shards) - min(s.num_rows for s in shards) <= 1
    together = pa.concat_tables(shards)
    assert row_keys(together) == row_keys(built)
    assert together.column("input_ids").to_pylist() != built.column("input_ids").to_pylist()

    # This folder's shards were cut from one permutation with no record of a bucket size: as if the
    # code before buckets had begun them, so a resume finishes them with that permutation.
    assert order_bucket(out, 48, "train", count, bucket_instances=7) == count
    # one bucket: nothing to record
    assert order_bucket(out, 48, "train", count, bucket_instances=count) == count
    fresh = tmp_path / "fresh"
    assert order_bucket(fresh, 48, "train", count, bucket_instances=7) == 7  # no shards yet: recorded
    (fresh / "seq48").mkdir()
    (fresh / "seq48" / "train-00000.arrow").write_bytes(b"")
    assert order_bucket(fresh, 48, "train", count, bucket_instances=7) == 7  # resumed: the record holds
    assert order_bucket(fresh, 48, "train", count, bucket_instances=9) == 7
    assert order_bucket(fresh, 48, "val", count, bucket_instances=7) == 7  # per (length, split)


def test_the_keyed_order_is_recorded_once_and_only_for_new_folders(tmp_path: Path) -> None:
    """keyed_buckets: over one bucket a fresh folder records the keyed order (B from the estimate) and every later
    call reads it back, the estimate unread; one bucket records nothing; a folder whose instance stage an earlier
    version began (markers, no record) or that holds the scatter order's record keeps the scatter order (0); a
    recorded bucket size alone (the tests' hook) gets its B once."""
    many = 3 * BUCKET_INSTANCES + 1
    fresh = tmp_path / "fresh"
    assert keyed_buckets(fresh, 128, "train", lambda: many) == 4
    record = json.loads((fresh / "work" / "shards" / "seq128-train-order.json").read_text())
    assert record == {"order": ORDER_KEYED, "bucket_instances": BUCKET_INSTANCES, "buckets": 4}
    assert keyed_buckets(fresh, 128, "train", lambda: pytest.fail("the record holds")) == 4
    assert recorded_buckets(fresh, 128, "train") == 4 and recorded_buckets(fresh, 128, "val") == 0
    assert keyed_buckets(fresh, 128, "val", lambda: BUCKET_INSTANCES) == 0
    assert not (fresh / "work" / "shards" / "seq128-val-order.json").exists()
    begun = tmp_path / "begun"
    (begun / "work" / "done").mkdir(parents=True)
    (begun / "work" / "done" / "instances-seq128-00003.json").write_text("{}")
    assert keyed_buckets(begun, 128, "train", lambda: many) == 0
    assert keyed_buckets(begun, 512, "train", lambda: many) == 4  # another length: not begun
    assert not (begun / "work" / "shards" / "seq128-train-order.json").exists()
    scatter = tmp_path / "scatter"
    (scatter / "work" / "shards").mkdir(parents=True)
    (scatter / "work" / "shards" / "seq128-train-order.json").write_text(json.dumps({"bucket_instances": 50}))
    assert keyed_buckets(scatter, 128, "train", lambda: many) == 0 and recorded_buckets(scatter, 128, "train") == 0
    (scatter / "work" / "shards" / "seq128-train-order.json").write_text(
        json.dumps({"order": ORDER_KEYED, "bucket_instances": 50}))
    assert keyed_buckets(scatter, 128, "train", lambda: 120) == 3
    assert keyed_buckets(scatter, 128, "train", lambda: 10**6) == 3  # derived once
