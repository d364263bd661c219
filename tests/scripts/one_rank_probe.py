"""One plain process of `pretrain.train.main` (no launcher) that records what its process group is.

    python tests/scripts/one_rank_probe.py OUT.json --config RUN.json [--section.key=value ...]

tests/pretrain/test_engine.py starts it in a fresh interpreter (the process group, its timeout and DeepSpeed's
shared-memory segment are per process) and reads OUT.json: the backend, the default group's timeout,
LOCAL_RANK as DeepSpeed saw it, and this rank's CPU all-reduce segment (its name, whether the name is
still in /dev/shm, and whether this process had it mapped, i.e. DeepSpeed really created it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.distributed.process_group import cpu_shm_segment
from pretrain.train import main
from pretrain.trainer import PhaseTrainer
from tests.support.extensions import AfterEachStep
from tests.support.launching import leave_without_teardown


def probe(out: Path):
    def callback(trainer: PhaseTrainer) -> None:
        if out.exists():
            return
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # the gloo group's own options
        segment = cpu_shm_segment(dist.get_rank())
        maps = Path("/proc/self/maps").read_text()
        out.write_text(json.dumps({
            "backend": dist.get_backend(),
            "timeout_s": backend.options._timeout.total_seconds(),
            "local_rank": os.environ["LOCAL_RANK"],
            "device_local_rank": trainer.dist_info.local_rank,
            "segment": str(segment),
            "segment_mapped": str(segment) in maps,
            "segment_listed": segment.exists(),
        }))

    return callback


if __name__ == "__main__":
    target = Path(sys.argv[1])
    leave_without_teardown(main(sys.argv[2:], extensions=[AfterEachStep(probe(target))]))
