"""The counter-based training order (pretrain/data/order.py): a bijection for every size, a rank's memory that does
not grow with the corpus, orders that look uniform, and the world-size-invariant stream it feeds.

Everything is seeded: the statistical checks are deterministic numbers with generous bounds, never flaky."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from pretrain.data.order import (
    FEISTEL_ORDER,
    LEGACY_ORDER,
    MAX_TOTAL,
    ORDERS,
    ROUNDS,
    InstancePool,
    RankOrder,
    epoch_keys,
    feistel_keys,
    feistel_permute,
    feistel_unpermute,
    partition_indices,
)
from pretrain.trainer import PhaseState


def test_the_permutation_is_a_bijection_of_every_size_up_to_300_and_inverts() -> None:
    for total in range(1, 301):
        for seed in (0, 1, 977):
            keys = epoch_keys(seed, total)
            values = feistel_permute(np.arange(total), total, keys)
            assert np.array_equal(np.sort(values), np.arange(total)), (total, seed)
            assert np.array_equal(feistel_unpermute(values, total, keys), np.arange(total)), (total, seed)


@pytest.mark.parametrize("total", [2**16, 2**16 + 1, 99_991, 3 * 2**15 - 1])
def test_the_permutation_is_a_bijection_of_larger_sizes(total: int) -> None:
    keys = epoch_keys(5, 1)
    values = feistel_permute(np.arange(total), total, keys)
    assert np.array_equal(np.sort(values), np.arange(total))
    assert not np.array_equal(values, np.arange(total))


@pytest.mark.parametrize("total", [10**9, 2**40 + 3, MAX_TOTAL])
def test_huge_sizes_stay_in_range_and_invert_at_sampled_positions(total: int) -> None:
    keys = epoch_keys(11, 2)
    positions = np.unique(np.concatenate([np.random.default_rng(total % 2**32).integers(0, total, 5000),
                                          [0, 1, total - 2, total - 1]]))
    values = feistel_permute(positions, total, keys)
    assert values.min() >= 0 and values.max() < total and len(np.unique(values)) == len(values)
    assert np.array_equal(feistel_unpermute(values, total, keys), positions)
    # evaluated one at a time or together: the same values (a position's value is a pure function of it)
    assert [int(feistel_permute(np.array([p]), total, keys)[0]) for p in positions[:5]] == values[:5].tolist()


def test_out_of_range_positions_and_sizes_are_refused() -> None:
    keys = epoch_keys(0, 0)
    with pytest.raises(IndexError):
        feistel_permute(np.array([10]), 10, keys)
    with pytest.raises(IndexError):
        feistel_permute(np.array([-1]), 10, keys)
    with pytest.raises(ValueError):
        feistel_permute(np.array([0]), MAX_TOTAL + 1, keys)
    with pytest.raises(ValueError, match="keys of shape"):
        feistel_permute(np.arange(3), 10, keys[:4])


def many_orders(total: int, count: int) -> np.ndarray:
    """`count` whole orders of [0, total), one per seed, as rows: one vectorised call (a key column per position)."""
    keys = np.stack([epoch_keys(seed, 0) for seed in range(count)], axis=1)  # (ROUNDS, count)
    columns = np.repeat(keys, total, axis=1)
    return feistel_permute(np.tile(np.arange(total), count), total, columns).reshape(count, total)


def chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


def test_over_many_keys_each_position_takes_each_value_equally_often() -> None:
    """total = 10, 20 000 seeds: the position x value table and the (first, second) value pairs are uniform within
    noise (4 rounds without the 8-bit floor scored 740 on the first's 81 degrees of freedom)."""
    total, count = 10, 20_000
    orders = many_orders(total, count)
    assert all(np.array_equal(np.sort(row), np.arange(total)) for row in orders[:50])
    table = np.zeros((total, total))
    np.add.at(table, (np.tile(np.arange(total), count), orders.ravel()), 1)
    dof = (total - 1) ** 2  # 81: mean 81, standard deviation 12.7
    assert chi_square(table) < dof + 5 * np.sqrt(2 * dof), chi_square(table)
    pairs = np.zeros((total, total))
    np.add.at(pairs, (orders[:, 0], orders[:, 1]), 1)
    off_diagonal = pairs[~np.eye(total, dtype=bool)]
    assert not pairs[np.eye(total, dtype=bool)].any()
    dof = total * (total - 1) - 1  # 89
    assert chi_square(off_diagonal) < dof + 5 * np.sqrt(2 * dof), chi_square(off_diagonal)
    # small sizes too (the cycle walk from the 2^8 floor): where position 0 lands, for 3, 5 and 7 values
    for small in (3, 5, 7):
        first = np.bincount(many_orders(small, 6000)[:, 0], minlength=small)
        assert chi_square(first) < (small - 1) + 5 * np.sqrt(2 * (small - 1)), (small, first)


def test_consecutive_positions_are_not_correlated() -> None:
    total = 10**6
    values = feistel_permute(np.arange(200_000), total, epoch_keys(3, 0)).astype(np.float64)
    # independent uniform values: mean |difference| total / 3, correlation 0 (standard error 1 / sqrt(n) = 0.0022)
    assert np.mean(np.abs(np.diff(values))) / total == pytest.approx(1 / 3, abs=0.005)
    assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.01
    assert np.mean(values) / total == pytest.approx(0.5, abs=0.005)
    # another epoch, another seed: another order, unrelated to this one
    for keys in (epoch_keys(3, 1), epoch_keys(4, 0)):
        other = feistel_permute(np.arange(200_000), total, keys).astype(np.float64)
        assert abs(np.corrcoef(values, other)[0, 1]) < 0.01 and np.mean(values == other) < 0.001


def peak_bytes(work) -> int:  # noqa: ANN001
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("num_parts", [1, 3])
def test_a_rank_reads_a_billion_instances_without_an_array_of_them(num_parts: int) -> None:
    """10^9 instances, 8 ranks, micro-batch 48: building the order and reading micro-batches (the rank's first, the
    one that straddles epochs 0 and 1, the next, one in epoch 3) allocates kilobytes; numpy's permutation of the
    epoch would take 8 GB."""
    total, world, micro = 10**9, 8, 48
    per_epoch = total if num_parts == 1 else -(-total // num_parts)  # part 0's size
    chunk = per_epoch // micro  # straddles epochs 0 and 1: per_epoch is no multiple of 48
    rank, k = chunk % world, chunk // world
    reads: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def work() -> None:
        order = RankOrder(total, seed=3, rank=rank, world_size=world, micro_batch=micro, num_parts=num_parts)
        assert len(order.pool) == per_epoch
        for item in (0, k, k + 1, 3 * per_epoch // (world * micro) + 1):
            reads[item] = order.samples((item * world + rank) * micro, micro)

    peak = peak_bytes(work)
    assert peak < 1_000_000, f"{peak} bytes at the peak"
    assert sorted(set(reads[k][0].tolist())) == [0, 1] and set(reads[k + 1][0].tolist()) == {1}
    assert set(reads[max(reads)][0].tolist()) == {3}
    for epochs, instances in reads.values():
        assert len(instances) == micro and instances.min() >= 0 and instances.max() < total
        for epoch in set(epochs.tolist()):  # an instance once per epoch
            assert len(np.unique(instances[epochs == epoch])) == (epochs == epoch).sum()
    if num_parts == 1:  # the instance at a position is the permutation's value there (the identity pool)
        epochs, instances = reads[0]
        positions = (rank * micro + np.arange(micro))
        assert np.array_equal(feistel_unpermute(instances, total, epoch_keys(3, 0)), positions)


def test_the_memory_check_sees_a_total_sized_array() -> None:
    """The probe above would notice: the legacy order's epoch permutation of 10^6 instances peaks past 8 MB."""
    order = RankOrder(10**6, seed=3, rank=0, world_size=2, micro_batch=4, name=LEGACY_ORDER)
    assert peak_bytes(lambda: order.samples(0, 4)) > 8 * 10**6


def stream_rows(total: int, world: int, micro: int, samples: int, **kwargs) -> list[tuple[int, int]]:  # noqa: ANN003
    """(epoch, instance) of stream samples 0 .. samples-1, read rank by rank the way each rank reads its chunks."""
    orders = [RankOrder(total, 7, rank, world, micro, **kwargs) for rank in range(world)]
    out: list[tuple[int, int]] = []
    for start in range(0, samples, micro):
        epochs, instances = orders[(start // micro) % world].samples(start, micro)
        out.extend(zip(epochs.tolist(), instances.tolist(), strict=True))
    return out


@pytest.mark.parametrize("order", ORDERS)
def test_every_world_size_reads_the_same_stream_and_each_epoch_is_every_instance_once(order: str) -> None:
    total = 1000
    reference = stream_rows(total, 1, 8, 3 * total, name=order)
    for world, micro in ((2, 4), (3, 8), (5, 2), (8, 1)):
        assert stream_rows(total, world, micro, 3 * total, name=order) == reference, (world, micro)
    for epoch in range(3):
        instances = [i for e, i in reference if e == epoch]
        assert sorted(instances) == list(range(total))
    assert [i for e, i in reference if e == 0] != [i for e, i in reference if e == 1]  # reshuffled every epoch


def test_the_legacy_order_is_numpys_epoch_permutation() -> None:
    """A checkpoint without an order name resumes on this: it must be the order such runs started with."""
    order = RankOrder(100, 3, 1, 2, 4, name=LEGACY_ORDER)
    picks = np.random.default_rng([3, 2]).permutation(100)
    assert np.array_equal(order.rank_indices(2), picks[order.rank_positions(2)])
    epochs, instances = order.samples(2 * 100 + 4, 4)  # chunk 51 (of rank 1): epoch 2, positions 4 .. 7
    assert epochs.tolist() == [2] * 4 and instances.tolist() == picks[4:8].tolist()
    assert RankOrder(100, 3, 1, 2, 4).name == FEISTEL_ORDER  # what new runs read
    assert np.array_equal(RankOrder(100, 3, 1, 2, 4).rank_indices(2),
                          feistel_permute(np.arange(100), 100, epoch_keys(3, 2))[order.rank_positions(2)])


def test_a_sample_of_another_rank_is_refused() -> None:
    order = RankOrder(100, 3, rank=1, world_size=2, micro_batch=4)
    with pytest.raises(IndexError, match="stream sample 0 is not in rank 1's chunks"):
        order.samples(0, 4)
    with pytest.raises(IndexError, match="stream sample 8 is not in rank 1's chunks"):
        order.samples(6, 4)


def test_parts_are_disjoint_balanced_seed_free_and_computed_where_read() -> None:
    for total, num_parts in ((1000, 3), (64, 2), (7, 7), (5, 8)):
        parts = [partition_indices(total, p, num_parts) for p in range(num_parts)]
        assert sorted(np.concatenate(parts).tolist()) == list(range(total))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        for p in range(num_parts):
            pool = InstancePool(total, p, num_parts)
            assert len(pool) == len(parts[p])
            if len(pool):
                assert np.array_equal(np.sort(pool[np.arange(len(pool))]), parts[p])
                assert isinstance(pool[0], int)
    with pytest.raises(IndexError):
        InstancePool(10, 0, 3)[4]
    with pytest.raises(ValueError, match="data.part"):
        InstancePool(10, 3, 3)
    with pytest.raises(ValueError, match="unknown data order"):
        InstancePool(10, 0, 1, "shuffled")
    assert feistel_keys(1, 2).shape == (ROUNDS,) and feistel_keys(1, 2).dtype == np.uint64


def test_a_phase_state_names_its_order_and_one_without_a_name_is_the_legacy_order() -> None:
    """New runs record feistel-v1 in trainer_state.json; a state written before the orders had names resumes on
    numpy's permutation, so a run in flight reads on exactly."""
    assert PhaseState("phase1").data_permutation == FEISTEL_ORDER
    assert PhaseState.from_dict(PhaseState("phase1").state_dict()).data_permutation == FEISTEL_ORDER
    before = {"phase": "phase1", "step": 3, "data_position": 48, "data_order": 2}
    assert PhaseState.from_dict(before).data_permutation == LEGACY_ORDER
