"""splitmix64's finaliser, the one keyed hash of the toolkit's orders (numpy only).

Two orders are computed where they are needed instead of drawn as arrays of the corpus' size: data prep's shuffle
buckets (data_prep/shard_stage.py: instance -> bucket) and the trainer's counter-based epoch order
(pretrain/data/order.py: a Feistel network's round function). Both mix a 64-bit word so that every output bit
depends on every input bit; one function, so that the two cannot drift apart.
"""

from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: its state after i steps is key + i * GOLDEN
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each uint64 (a new array; uint64 arrays wrap, never warn)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def splitmix_outputs(indices: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's output number i+1 from state `key`, for each uint64 index i: any output computed alone, the
    same in every process (the shuffle buckets' hashes: data_prep/shard_stage.py, data_prep/keyed_order.py)."""
    return mix64((indices + np.uint64(1)) * GOLDEN + key)
