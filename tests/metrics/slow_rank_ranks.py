"""Launched on 2 CPU ranks by tests/metrics/test_slow_ranks.py: real runs of `pretrain.train.main` with a planted
slow rank, both scenarios in one launch (phase 1 alone, 12 steps, windows of 4, run.evict_slow=true, and
run.slow_rank_threshold=0.15: the middle of 5 % and 30 % on a clock whose data waits move by some percent).

The plant (a test's hook, not the product's): from the first step's end every rank's model forward is held to a
fixed duration, PLANTED_S (it sleeps what its real compute left of it); on rank 1 to 1.05 times that, and from step
SLOW_FROM on to 1.3 times. The measured forward times are the plant's, whatever else the machine runs; PLANTED_S is
long beside the data waits of a loaded 2-core machine (up to ~45 ms a step were seen), which count too.

    named   no spare node: rank 1 named from the second window on, kept; the run goes on to its end
    evict   BERT_DS_NODES_SPARE=1: named, then a checkpoint, exit 5 on every rank and `evicting host` on rank 1

Each rank writes its exit status to WORKDIR/<scenario>.rank<N>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pretrain.errors import NODES_SPARE_ENV
from pretrain.train import main
from tests.support.extensions import after_each_step
from tests.support.launching import leave_without_teardown

PLANTED_S = 0.2  # every forward's duration under the plant (the tiny model's own forward: a few ms)
SLOW_FROM = 4  # rank 1 is 30 % slow from this 0-based step on: the second window of 4 steps is the first all slow
SCENARIOS = {"named": False, "evict": True}  # a spare node


def plant():
    """The after-step callback that wraps the model's forward once (module docstring)."""

    def callback(trainer: Any) -> None:
        module = trainer.engine.module
        if "forward" in vars(module):
            return
        original = module.forward
        slow = dist.get_rank() == 1

        def held(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            output = original(*args, **kwargs)
            duration = PLANTED_S * ((1.3 if trainer.state.step >= SLOW_FROM else 1.05) if slow else 1.0)
            time.sleep(max(0.0, duration - (time.perf_counter() - started)))
            return output

        module.forward = held  # an instance attribute: module.__call__ (and the monitor's hooks around it) calls it

    return callback


def run(scenario: str, workdir: Path) -> None:
    spare = SCENARIOS[scenario]
    os.environ.pop(NODES_SPARE_ENV, None)
    if spare:
        os.environ[NODES_SPARE_ENV] = "1"
    argv = ["--config", str(workdir / "run.json"), f"--run.dir={workdir / scenario}", '--run.phases=["phase1"]',
            "--phase1.steps=12", "--run.slow_rank_window_steps=4", "--run.evict_slow=true",
            "--run.slow_rank_threshold=0.15",
            "--model.attention=padded", "--checkpoint.every_steps=100", "--checkpoint.export_at_phase_end=false",
            "--logging.val_every_steps=0"]
    status = main(argv, after_each_step(plant()))
    (workdir / f"{scenario}.rank{dist.get_rank()}.json").write_text(json.dumps(status))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        run(name, Path(sys.argv[1]))
    leave_without_teardown()
