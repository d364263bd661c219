"""Which instance a rank reads at each sample of the training stream, computed at the samples it reads.

Why counter-based. An epoch's order drawn as a permutation array costs 8 bytes per instance in every rank
(and in every DataLoader worker) at every epoch start: 8 GB per process at 10^9 instances. The order
"feistel-v1" is a keyed pseudorandom permutation P of [0, total) evaluated where it is needed: the sample at
position i of epoch e is instance pool[P_(seed, e)(i)]. A micro-batch costs a few vector operations on its own
m positions; nothing a rank holds grows with the corpus, and any position is produced directly (resume, any
world size), as before.

The permutation: a Feistel network on n-bit integers, n = max(MIN_BITS, bits of total - 1). The high part
has n // 2 bits, the low part the rest, and the parts swap widths every round, so an odd n needs no padding.
Round i maps (L, R) to (R, L xor F_i(R)), F_i(R) = splitmix64's finaliser of (R xor k_i), cut to L's width;
the round keys k_i come from SeedSequence([ORDER_SALT, seed, epoch]). A Feistel network is a bijection of
[0, 2^n) whatever its round functions; a value >= total is encrypted again until it lands in [0, total)
(cycle walking: following the 2^n permutation's cycle from a position in [0, total) to the next member of
[0, total) is itself a bijection of [0, total)). For total > 2^MIN_BITS the domain is under 2 x total, so
under two encryptions per position on average. Why ROUNDS = 8 and MIN_BITS = 8 rather than Luby-Rackoff's
4 rounds: that bound is asymptotic, and 4 rounds on a small bare power of two were biased (chi-square 740 on
81 degrees of freedom for where positions land at total = 10 over 20 000 keys; 8 rounds over at least 2^8
values: about 90, noise); tests/data/test_order.py keeps that check.

Parts: the deal into `num_parts` parts is the same permutation keyed by (PARTITION_SALT, instances,
num_parts), never by the seed: part p holds the instances at positions p, p + num_parts, p + 2 num_parts, ...
of it, so the parts are disjoint, cover everything and differ in size by at most one.

"numpy-permutation" (LEGACY_ORDER) is the order of runs started before this module: default_rng([seed,
epoch]).permutation(total), the parts from one numpy permutation of every instance. A checkpoint whose
trainer state does not name its order was written with it, and resumes on it (pretrain/trainer.py
PhaseState), so a run in flight stays exact; it keeps that order's total-sized arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data_prep.shard_format.keyed_hash import mix64

FEISTEL_ORDER = "feistel-v1"
LEGACY_ORDER = "numpy-permutation"
ORDERS = (FEISTEL_ORDER, LEGACY_ORDER)
ORDER_SALT = 0x0DE7_F215  # epoch keys: never those of the deal into parts
PARTITION_SALT = 0xD15_70177  # the deal into disjoint parts: fixed, independent of every seed
ROUNDS = 8
MIN_BITS = 8
MAX_TOTAL = 1 << 62  # shifts of n-bit halves stay inside uint64


def feistel_keys(*words: int) -> np.ndarray:
    """ROUNDS round keys (uint64) from non-negative integers of any size."""
    return np.random.SeedSequence(list(words)).generate_state(ROUNDS, dtype=np.uint64)


def epoch_keys(seed: int, epoch: int) -> np.ndarray:
    """The round keys of the training order of `epoch` under `seed`."""
    return feistel_keys(ORDER_SALT, seed, epoch)


def _widths(bits: int) -> list[tuple[int, int]]:
    """(high, low) widths of each round: they swap every round."""
    high, low = bits // 2, bits - bits // 2
    out = []
    for _ in range(ROUNDS):
        out.append((high, low))
        high, low = low, high
    return out


def _encrypt(x: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    for key, (high, low) in zip(keys, _widths(bits), strict=True):
        left, right = x >> low, x & np.uint64((1 << low) - 1)
        x = (right << high) | (left ^ (mix64(right ^ key) & np.uint64((1 << high) - 1)))
    return x


def _decrypt(y: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    for key, (high, low) in reversed(list(zip(keys, _widths(bits), strict=True))):
        right, left = y >> high, y & np.uint64((1 << high) - 1)
        y = ((left ^ (mix64(right ^ key) & np.uint64((1 << high) - 1))) << low) | right
    return y


def _walk(positions: np.ndarray, total: int, keys: np.ndarray, forward: bool) -> np.ndarray:
    if not 1 <= total <= MAX_TOTAL:
        raise ValueError(f"a keyed permutation needs 1 <= total <= 2^62, not {total}")
    positions = np.asarray(positions)
    if positions.size and (positions.min() < 0 or positions.max() >= total):
        raise IndexError(f"positions outside [0, {total})")
    if total == 1:
        return np.zeros(positions.shape, dtype=np.int64)
    bits = max(MIN_BITS, (total - 1).bit_length())
    step = _encrypt if forward else _decrypt
    keys = np.asarray(keys, dtype=np.uint64)
    if keys.shape not in ((ROUNDS,), (ROUNDS, positions.size)):
        raise ValueError(f"keys of shape {keys.shape}: ({ROUNDS},) or ({ROUNDS}, {positions.size}) expected")
    x = step(positions.astype(np.uint64).ravel(), bits, keys)
    out = np.flatnonzero(x >= total)
    while out.size:  # cycle walking: on along the cycle until back inside [0, total)
        x[out] = step(x[out], bits, keys if keys.ndim == 1 else keys[:, out])
        out = out[x[out] >= total]
    return x.astype(np.int64).reshape(positions.shape)


def feistel_permute(positions: np.ndarray, total: int, keys: np.ndarray) -> np.ndarray:
    """P(positions): the keyed permutation of [0, total) at these positions only (int64, a new array). `keys`:
    one permutation's (ROUNDS,), or one column per position (ROUNDS, positions.size): many permutations in one
    vectorised call, as the statistical tests draw them."""
    return _walk(positions, total, keys, forward=True)


def feistel_unpermute(values: np.ndarray, total: int, keys: np.ndarray) -> np.ndarray:
    """P^-1(values): the positions where the keyed permutation of [0, total) puts these values."""
    return _walk(values, total, keys, forward=False)


def legacy_partition(total: int, part: int, num_parts: int) -> np.ndarray:
    """LEGACY_ORDER's part `part`: sorted instance indices from one numpy permutation of all `total`."""
    deal = np.random.default_rng([PARTITION_SALT, total, num_parts]).permutation(total)
    return np.sort(deal[part::num_parts])


class InstancePool:
    """The instances a run reads (all, or its part): pool position -> instance index, by arithmetic (a part of
    the feistel-v1 deal) or, for the legacy order's parts only, from an array."""

    def __init__(self, instances: int, part: int = 0, num_parts: int = 1, order: str = FEISTEL_ORDER) -> None:
        if num_parts < 1 or not 0 <= part < num_parts:
            raise ValueError(f"data.part: {part} is not a part of {num_parts}")
        if order not in ORDERS:
            raise ValueError(f"unknown data order {order!r} (known: {', '.join(ORDERS)})")
        self.instances, self.part, self.num_parts = instances, part, num_parts
        self.size = max(0, -(-(instances - part) // num_parts))  # positions part, part + num_parts, ... < instances
        self._array = legacy_partition(instances, part, num_parts) if order == LEGACY_ORDER and num_parts > 1 else None
        self._keys = feistel_keys(PARTITION_SALT, instances, num_parts)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, positions: int | np.ndarray) -> int | np.ndarray:
        at = np.asarray(positions, dtype=np.int64)
        if at.size and (at.min() < 0 or at.max() >= self.size):
            raise IndexError(f"pool positions outside [0, {self.size})")
        if self._array is not None:
            found = self._array[at]
        elif self.num_parts == 1:
            found = at.copy()
        else:
            found = feistel_permute(at * self.num_parts + self.part, self.instances, self._keys)
        return int(found) if found.ndim == 0 else found


def partition_indices(total: int, part: int, num_parts: int, order: str = FEISTEL_ORDER) -> np.ndarray:
    """Instance indices of part `part` of `num_parts` disjoint parts, sorted: the whole part as an array (for
    tests and tools; the trainer's InstancePool computes only the positions it reads)."""
    pool = InstancePool(total, part, num_parts, order)
    return np.sort(np.asarray(pool[np.arange(len(pool))]))


@dataclass(eq=False)
class RankOrder:
    """Stream samples of one rank -> (epoch, instance), for micro-batches dealt round robin (pretrain/data/batches.py
    RankBatches): chunk c = samples c*m .. c*m+m-1 is this rank's when c % world_size == rank. Epoch e holds stream
    samples [e*total, (e+1)*total), total = the pool's size. Without `shuffle` an epoch is the pool in order."""

    instances: int
    seed: int
    rank: int
    world_size: int
    micro_batch: int
    shuffle: bool = True
    part: int = 0
    num_parts: int = 1
    name: str = FEISTEL_ORDER
    pool: InstancePool = field(init=False, repr=False)
    _keys: dict[int, np.ndarray] = field(init=False, repr=False, default_factory=dict)
    _slices: dict[int, tuple[np.ndarray, np.ndarray]] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.pool = InstancePool(self.instances, self.part, self.num_parts, self.name)

    @property
    def total(self) -> int:
        return len(self.pool)

    def at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The instances at `positions` (this rank's) of `epoch`."""
        if not self.shuffle:
            return np.asarray(self.pool[positions])
        if self.name == LEGACY_ORDER:
            mine, instances = self._legacy_slice(epoch)
            return instances[np.searchsorted(mine, positions)]
        if epoch not in self._keys:
            self._keys = {e: k for e, k in self._keys.items() if e == epoch - 1}  # a chunk may straddle two epochs
            self._keys[epoch] = epoch_keys(self.seed, epoch)
        return np.asarray(self.pool[feistel_permute(positions, self.total, self._keys[epoch])])

    def samples(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(epochs, instances) of stream samples first .. first+count-1, which must be this rank's."""
        samples = np.arange(first, first + count, dtype=np.int64)
        foreign = samples[(samples // self.micro_batch) % self.world_size != self.rank]
        if foreign.size:
            raise IndexError(f"stream sample {int(foreign[0])} is not in rank {self.rank}'s chunks")
        epochs, positions = np.divmod(samples, self.total)
        instances = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            here = epochs == epoch
            instances[here] = self.at(epoch, positions[here])
        return epochs, instances

    def rank_positions(self, epoch: int) -> np.ndarray:
        """Positions within `epoch` of the samples in this rank's chunks, built from this rank's chunks alone."""
        total, micro = self.total, self.micro_batch
        begin, end = epoch * total, (epoch + 1) * total
        first_chunk = begin // micro
        first_mine = first_chunk + (self.rank - first_chunk) % self.world_size
        chunks = np.arange(first_mine, (end - 1) // micro + 1, self.world_size, dtype=np.int64)
        samples = (chunks[:, None] * micro + np.arange(micro, dtype=np.int64)[None, :]).ravel()
        return samples[(samples >= begin) & (samples < end)] - begin

    def rank_indices(self, epoch: int) -> np.ndarray:
        """This rank's instances of the whole of `epoch`, in stream order (its own array: tests and tools)."""
        return np.array(self.at(epoch, self.rank_positions(epoch)), dtype=np.int64)

    def epoch_end(self, k: int) -> int:
        """The first micro-batch after `k` whose first sample lies in a later epoch than `k`'s first sample.

        Micro-batch k of rank r starts at stream sample (k * world_size + r) * micro_batch."""
        total, micro, rank = self.total, self.micro_batch, self.rank
        epoch = (k * self.world_size + rank) * micro // total
        next_epoch_start = (epoch + 1) * total - rank * micro  # k' * world_size * micro must reach this
        return max(k + 1, -(-next_epoch_start // (self.world_size * micro)))

    def prepare(self, first: int, end: int) -> None:
        """The legacy order: compute this rank's slice of every epoch micro-batches first .. end-1 read, here,
        so DataLoader workers forked after share it. feistel-v1 has nothing to compute ahead."""
        if self.name != LEGACY_ORDER or not self.shuffle:
            return
        total = self.total
        first_sample = (first * self.world_size + self.rank) * self.micro_batch
        last_sample = ((end - 1) * self.world_size + self.rank) * self.micro_batch + self.micro_batch - 1
        for epoch in range(first_sample // total, last_sample // total + 1):
            self._legacy_slice(epoch)

    def _legacy_slice(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """LEGACY_ORDER: this rank's positions of `epoch` and the instances there, from the epoch's whole numpy
        permutation. Only this rank's share is kept (a copy); at most two epochs (a micro-batch may straddle a
        boundary)."""
        if epoch not in self._slices:
            picks = np.random.default_rng([self.seed, epoch]).permutation(self.total)
            positions = self.rank_positions(epoch)
            self._slices[epoch] = (positions, np.asarray(self.pool[picks[positions]]).copy())
            while len(self._slices) > 2:
                del self._slices[min(self._slices)]
        return self._slices[epoch]
