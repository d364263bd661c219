"""Peak memory of this rank's process, a step monitor (pretrain/metrics/monitor_contract.py).

The peaks, not the current use: what a run needs is the high-water mark its batch and sequence length reach,
which tells how much headroom a larger micro-batch has. Host-side counters only: no device work, no sync.
"""

from __future__ import annotations

import resource
from typing import Any

import torch

from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.step_stats import StepResult


class MemoryStats(StepMonitor):
    """This rank's peak memory so far (the allocator's counters on CUDA, the process's resident set on a CPU).

    Tags:
        memory/max_allocated_gb  [cuda] the GPU's peak allocated memory, GiB
        memory/max_reserved_gb   [cuda] the GPU's peak memory reserved by torch's caching allocator, GiB
        memory/max_rss_gb        [cpu] the process's peak resident memory, GiB
    """

    device = torch.device("cpu")

    def attach(self, engine: Any) -> None:
        self.device = torch.device(engine.device)

    def values(self, result: StepResult) -> dict[str, float]:
        return memory_stats(self.device)


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "memory/max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/max_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    # ru_maxrss is in KiB on Linux: the peak resident memory of this rank's process.
    return {"memory/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
