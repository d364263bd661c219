"""This process's place in the job, as a plain value every module passes around (no torch.distributed calls).

Its own leaf so that the trainer's and the plug-in contract's types import without DeepSpeed:
pretrain/engine.py joins the process group and builds the value, everything else only reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int  # the accelerator index this rank uses (see device_index), also LOCAL_RANK from then on
    device: torch.device


@dataclass(frozen=True)
class Launch:
    """Which launch of torch's elastic agent started this process, and which restart of it (0: its first start).
    None/0 without the agent (a plain process, a test)."""

    run_id: str | None
    restart: int

    @classmethod
    def from_env(cls) -> Launch:
        """TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT, which the agent sets for every rank it starts."""
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or None
        return cls(run_id, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) if run_id else 0)
