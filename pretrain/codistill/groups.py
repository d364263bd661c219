"""Rank layout and process groups for codistillation: contiguous rank blocks, one engine per process.

With W ranks and n groups, group g owns ranks [g*W/n, (g+1)*W/n). Each group is an ordinary
data-parallel job whose DeepSpeed engine sees only its own block through an `mpu` (ZeRO partitions
and gradient all-reduces stay inside the group). Ranks with the same position inside their groups
form an "exchange" group of n ranks, over which teacher weights are all-gathered.

`torch.distributed.new_group` is collective over the world: every rank creates every group, in the
same order, before any engine exists (docs/codistillation.md, "Design notes").

Separate jobs (`job_group` set): this job's whole world is that one group; there is no other group
in it, no mpu (the world is the data-parallel group) and no exchange group (files only).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pretrain.config.sections import RunSection


@dataclass(frozen=True)
class GroupLayout:
    world_size: int
    groups: int
    rank: int
    job_group: int | None = None  # separate jobs: this job's world is group `job_group` alone

    def __post_init__(self) -> None:
        if self.job_group is not None:
            if not 0 <= self.job_group < self.groups:
                raise ValueError(f"codistill.group: {self.job_group} is not one of {self.groups} groups")
        elif self.groups < 1 or self.world_size % self.groups:
            raise ValueError(
                f"codistill.groups: {self.groups} groups do not split a world of {self.world_size} ranks into equal blocks"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def separate_jobs(self) -> bool:
        return self.job_group is not None

    @property
    def group_size(self) -> int:
        return self.world_size if self.separate_jobs else self.world_size // self.groups

    @property
    def group(self) -> int:
        return self.job_group if self.job_group is not None else self.rank // self.group_size

    @property
    def group_rank(self) -> int:
        return self.rank % self.group_size

    @property
    def first_rank(self) -> int:
        """Global rank of this group's rank 0."""
        return 0 if self.separate_jobs else self.group * self.group_size

    @property
    def groups_in_job(self) -> list[int]:
        return [self.group] if self.separate_jobs else list(range(self.groups))

    def ranks_of_group(self, group: int) -> list[int]:
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def exchange_ranks(self, group_rank: int) -> list[int]:
        """The ranks at position `group_rank` of every group, in group order."""
        return [g * self.group_size + group_rank for g in range(self.groups)]

    @property
    def other_groups(self) -> list[int]:
        return [g for g in range(self.groups) if g != self.group]


class GroupMPU:
    """The mpu interface DeepSpeed 0.19.8 queries: data parallel = my group, model parallel = me alone."""

    def __init__(self, layout: GroupLayout, dp_group: Any, mp_group: Any) -> None:
        self.layout, self.dp_group, self.mp_group = layout, dp_group, mp_group

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.layout.group_size

    def get_data_parallel_rank(self) -> int:
        return self.layout.group_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.layout.ranks_of_group(self.layout.group)

    def get_model_parallel_group(self) -> Any:
        return self.mp_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


@dataclass
class ProcessGroups:
    layout: GroupLayout
    mpu: GroupMPU | None  # None: the world is the group (separate jobs)
    data_parallel: Any  # my group's ranks (None: the world)
    exchange: Any  # my position in every group (teacher all-gather); None in separate jobs


def create_process_groups(layout: GroupLayout, timeout: timedelta | None = None) -> ProcessGroups:
    """Collective over the world: every rank must call it at the same point with the same layout.

    `timeout`: how long a collective of these groups waits, `run.dist_timeout_minutes` like the world's
    (None: that key's default). Without it a new group gets the backend's default (NCCL: 10 minutes),
    while a group's rank 0 alone converts or consolidates a checkpoint and the rest of the group waits
    in a broadcast: a slow file system would fail the job there, although the world waits 120 minutes.
    """
    if layout.separate_jobs:
        return ProcessGroups(layout=layout, mpu=None, data_parallel=None, exchange=None)
    if timeout is None:
        timeout = timedelta(minutes=RunSection().dist_timeout_minutes)
    data_parallel = [dist.new_group(layout.ranks_of_group(g), timeout=timeout) for g in range(layout.groups)]
    singles = [dist.new_group([r], timeout=timeout) for r in range(layout.world_size)]
    exchange = [dist.new_group(layout.exchange_ranks(p), timeout=timeout) for p in range(layout.group_size)]
    mine = data_parallel[layout.group]
    mpu = GroupMPU(layout, mine, singles[layout.rank])
    return ProcessGroups(layout=layout, mpu=mpu, data_parallel=mine, exchange=exchange[layout.group_rank])
