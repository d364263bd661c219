"""This process's place in the job, as a plain value every module passes around (no torch.distributed calls).

Its own leaf so that the trainer's and the plug-in contract's types import without DeepSpeed:
pretrain/engine.py joins the process group and builds the value, everything else only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int  # the accelerator index this rank uses (see device_index), also LOCAL_RANK from then on
    device: torch.device
