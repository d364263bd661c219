"""The micro-batches of each optimizer step, read one step ahead: the loop's feed from this rank's stream.

The loss normalisation (pretrain/optimizer_step.py) needs every label of a step before its first backward, so a
step's micro-batches are all on the host when the step starts. To hide the read, one micro-batch of the next
step is read after each micro-batch's device work is queued (`read_ahead`), while the device computes. The stream
opens at the phase's data position (samples of all ranks, pretrain/data/batches.py) the first time a step asks,
so a resumed process starts where the checkpoint left off. The seconds spent waiting for the loader are counted
per step (perf/data_wait_s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from pretrain.data.batches import RankBatches
from pretrain.data.loader import stream_batches

__all__ = ["StepFeed"]


class StepFeed:
    """This rank's micro-batches, handed out a step at a time; `wait_s` is what the current step waited."""

    def __init__(self, batches: RankBatches, num_workers: int) -> None:
        self.batches = batches
        self.num_workers = num_workers
        self._stream: Iterator[dict[str, torch.Tensor]] | None = None
        self._ahead: list[dict[str, torch.Tensor]] = []  # micro-batches of the next step, read during this one
        self.wait_s = 0.0

    def _open(self, data_position: int) -> Iterator[dict[str, torch.Tensor]]:
        per_chunk = self.batches.micro_batch * self.batches.world_size
        if data_position % per_chunk:
            raise ValueError(f"data position {data_position} is not a whole number of micro-batches "
                             f"of {per_chunk} samples over all ranks")
        return stream_batches(self.batches, data_position // per_chunk, self.num_workers)

    def _next(self, data_position: int) -> dict[str, torch.Tensor]:
        """The next micro-batch of the stream, on the host; the time waited for it is added to `wait_s`."""
        if self._stream is None:
            self._stream = self._open(data_position)
        started = time.perf_counter()
        batch = next(self._stream)
        self.wait_s += time.perf_counter() - started
        return batch

    def step_batches(self, data_position: int, count: int) -> list[dict[str, torch.Tensor]]:
        """The `count` micro-batches of the step that starts at `data_position`: those read during the previous
        step, and the rest now (all of them for the first step of this process or phase)."""
        self.wait_s = 0.0
        batches, self._ahead = self._ahead, []
        while len(batches) < count:
            batches.append(self._next(data_position))
        return batches

    def read_ahead(self, next_count: int) -> None:
        """Read one micro-batch of the next step, which takes `next_count` (0: this step is the phase's last)."""
        if len(self._ahead) < next_count:
            self._ahead.append(self._next(0))  # the stream is open: the position is not read
