"""Launched by tests/device_check/test_unpadded_check.py on 2 CPU ranks, each standing for a node (both its first local rank):
the kernel self-test fails on rank 1 only, or rank 1's device cannot run the kernel at all; every rank must then
run the same path. Writes WORKDIR/rank<N>.json: each scenario's paths per phase, or the refusal's line."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.device_check.settle import DeviceChecks, settle_attention
from pretrain.device_check.unpadded_check import kernel_self_test
from pretrain.errors import ConfigError
from tests.support.attention_plans import Place, across_segments, run_plan_stub
from tests.support.launching import leave_without_teardown


def main(workdir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = Place(rank=rank, local_rank=0)  # every rank is its node's first: each runs the test
    wrong_on_rank1 = functools.partial(kernel_self_test, kernel=across_segments) if rank == 1 else kernel_self_test
    scenarios = {
        "auto, the test fails on rank 1": (run_plan_stub("auto"), wrong_on_rank1),
        "unpadded, the test fails on rank 1": (run_plan_stub("unpadded"), wrong_on_rank1),
        "auto, rank 1 plans padded": (run_plan_stub("auto", unpadded=rank == 0), kernel_self_test),
        "auto, every test passes": (run_plan_stub("auto"), kernel_self_test),
    }
    outcome = {}
    for name, (plan, test) in scenarios.items():
        try:
            settled = settle_attention(plan, node, DeviceChecks(test=test))  # type: ignore[arg-type]
            outcome[name] = {phase: p.attention.path for phase, p in settled.phases.items()}
        except ConfigError as err:
            outcome[name] = str(err)
    (workdir / f"rank{rank}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    leave_without_teardown()
