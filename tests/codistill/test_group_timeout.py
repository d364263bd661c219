"""Codistillation's process groups wait as long as the world (run.dist_timeout_minutes), not the backend's
default: real gloo groups in this process (a world of one), their timeout read back from the backend."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from pretrain.codistill.groups import GroupLayout, create_process_groups
from pretrain.config.sections import RunSection


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """What the group's gloo backend will wait in a collective before it fails."""
    return group._get_backend(torch.device("cpu")).options._timeout


def test_every_group_gets_the_run_timeout() -> None:
    from pretrain.distributed.process_group import init_distributed

    init_distributed()  # idempotent: a world of one over gloo (DS_ACCELERATOR=cpu), shared with other tests
    layout = GroupLayout(world_size=1, groups=1, rank=0)
    groups = create_process_groups(layout, timeout=timedelta(minutes=77))
    made = [groups.data_parallel, groups.exchange, groups.mpu.get_model_parallel_group()]
    assert [group_timeout(group) for group in made] == [timedelta(minutes=77)] * 3
    default = create_process_groups(layout)  # no timeout given: run.dist_timeout_minutes' default, not gloo's 30
    assert group_timeout(default.data_parallel) == timedelta(minutes=RunSection().dist_timeout_minutes)
    assert group_timeout(dist.new_group([0])) == timedelta(minutes=30)  # what a bare new_group gets
