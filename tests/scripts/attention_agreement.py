"""Launched by tests/device_check/test_unpadded_check.py on 2 CPU ranks, both LOCAL_RANK 0 (as with one GPU per
task). As two hosts (planted host names): the kernel self-test fails on rank 1 only, or rank 1's device cannot run
the kernel at all; every rank must then run the same path. As one host (one name): one rank tests for both, also
across a restart, which reads the run folder's verdict. Writes WORKDIR/rank<N>.json: each scenario's paths per
phase (or the refusal's line), and how many tests this rank ran with the line's words."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pretrain.device_check.run_shape import RunShape
from pretrain.device_check.settle import DeviceChecks, settle_attention
from pretrain.device_check.unpadded_check import kernel_self_test
from pretrain.device_check.verdict import SelfTestResult
from pretrain.errors import ConfigError
from tests.support.attention_plans import Place, across_segments, run_plan_stub
from tests.support.launching import leave_without_teardown


def main(workdir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = Place(rank=rank, local_rank=0)  # every rank is local rank 0, as srun --gpus-per-task=1 makes them
    own_host = f"node{rank}"  # two hosts, by name
    wrong_on_rank1 = functools.partial(kernel_self_test, kernel=across_segments) if rank == 1 else kernel_self_test
    scenarios = {
        "auto, the test fails on rank 1": (run_plan_stub("auto"), wrong_on_rank1),
        "unpadded, the test fails on rank 1": (run_plan_stub("unpadded"), wrong_on_rank1),
        "auto, rank 1 plans padded": (run_plan_stub("auto", unpadded=rank == 0), kernel_self_test),
        "auto, every test passes": (run_plan_stub("auto"), kernel_self_test),
    }
    outcome: dict[str, object] = {}
    for name, (plan, test) in scenarios.items():
        try:
            settled = settle_attention(plan, node, DeviceChecks(test=test, host=own_host))  # type: ignore[arg-type]
            outcome[name] = {phase: p.attention.path for phase, p in settled.phases.items()}
        except ConfigError as err:
            outcome[name] = str(err)
    runs: list[str] = []

    def counted(device: torch.device, precision: str, head_dim: int, seq_len: int,
                shape: RunShape | None) -> SelfTestResult:
        runs.append(precision)
        return kernel_self_test(device, precision, head_dim, seq_len, shape)

    with_run_folder = dataclasses.replace(run_plan_stub("auto"), job=SimpleNamespace(run_dir=workdir / "run"))
    counting = {
        "two hosts": (run_plan_stub("auto"), own_host),
        "one host": (run_plan_stub("auto"), "node"),
        "one host, a launch with a run folder": (with_run_folder, "node"),
        "one host, its restart": (with_run_folder, "node"),
    }
    for name, (plan, host) in counting.items():
        before = len(runs)
        settled = settle_attention(plan, node, DeviceChecks(test=counted, host=host))  # type: ignore[arg-type]
        why = settled.phases["phase1"].attention.why
        outcome[f"{name}: line"] = why[why.index("self-test passed"):why.index(":", why.index("self-test passed"))]
        outcome[f"{name}: tests on rank {rank}"] = len(runs) - before
    (workdir / f"rank{rank}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    leave_without_teardown()
