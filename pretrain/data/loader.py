"""How micro-batches reach the device: the resumable loader over a rank's stream and the move to the device.

The loader is a DataLoader per epoch over `RankBatches` items k, k+1, ... (workers change speed, never
content); `model_inputs` is the last host-side step before a forward, where what the host knows for free
(is any row padded?) saves the device a sync.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from pretrain.data.batches import RankBatches


class StreamSampler(Sampler[int]):
    """k, k+1, ... forever (or `count` items): the resumable position is the first k."""

    def __init__(self, start: int, count: int | None = None) -> None:
        self.start, self.count = start, count

    def __iter__(self) -> Iterator[int]:
        k = self.start
        while self.count is None or k < self.start + self.count:
            yield k
            k += 1


def batch_loader(batches: RankBatches, start: int, num_workers: int, count: int | None = None) -> DataLoader:
    """A DataLoader over micro-batches start, start+1, ...; workers only change speed, never content."""
    return DataLoader(
        batches,
        batch_size=None,
        sampler=StreamSampler(start, count),
        num_workers=num_workers,
        persistent_workers=False,
        prefetch_factor=4 if num_workers else None,
        pin_memory=torch.cuda.is_available(),
        multiprocessing_context="fork" if num_workers and os.name == "posix" else None,
    )


def stream_batches(batches: RankBatches, start: int, num_workers: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches start, start+1, ... forever, one DataLoader per epoch.

    Each item computes its own instances (the feistel-v1 order of pretrain/data/order.py: a few operations per
    position, nothing epoch-sized). Only a run resumed on the legacy numpy permutation has something to compute
    ahead: before each loader forks its workers, this process computes the rank's slice of the epochs that
    loader reads (`RankBatches.prepare`), which the workers share copy-on-write instead of each drawing the
    whole epoch permutation (8 bytes per instance of the corpus, per worker, at every epoch start)."""
    k = start
    while True:
        end = batches.epoch_end(k)
        batches.prepare(k, end)
        yield from batch_loader(batches, k, num_workers, count=end - k)
        k = end


def model_inputs(host_batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """A collated micro-batch on the device, as the model takes it.

    An all-ones attention mask becomes None here, where the batch is still on the host: given a mask,
    transformers checks `mask.all()` in a Python `if` (a device -> host sync in every forward) and SDPA
    cannot take the flash kernel. A padded batch keeps its mask (the model turns it into a 4D key mask,
    which transformers passes on without looking at it). Python numbers (an unpadded batch's `max_seqlen`)
    stay on the host."""
    no_padding = "attention_mask" in host_batch and bool(host_batch["attention_mask"].all())
    return {
        key: None if no_padding and key == "attention_mask"
        else value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        for key, value in host_batch.items()
    }
