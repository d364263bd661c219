"""Launched by tests/checkpointing/test_elastic_multirank.py on 1, 2 or 4 CPU ranks, and by
tests/pretrain/test_learns_facts.py on 2 (its two trainings in one launch): several `pretrain.train.main` runs.

    elastic_scenarios.py PLAN.json    runs every entry of the plan in order, in this one launch:
        {"name": ..., "config": RUN.json, "overrides": [...], "snapshot_steps": [s, ...], "snapshot_start": bool}

A snapshot is the model's whole training state gathered through DeepSpeed's own per-parameter API
(`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`, which read the flat partitions through
each parameter's `_hp_mapping`; the module itself at ZeRO-0), plus the optimizer step counts, the
learning rates, the scheduler position, DeepSpeed's counters and the trainer state. It is taken after
the listed steps (what the checkpoint written at that step holds) and, with `snapshot_start`, when a
phase starts (right after a resume loaded a checkpoint, before the first step). The model's rank 0
writes it to <run.dir>/snapshot_<step|start>.pt. Outcomes (exit codes) go to PLAN.outcomes.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from pretrain.engine import full_parameters
from pretrain.plugin import TrainingPlugin
from pretrain.train import main
from pretrain.trainer import PhaseTrainer
from tests.support.launching import leave_without_teardown


def snapshot(trainer: PhaseTrainer) -> dict[str, Any]:
    """Collective within the model's ranks: see the module docstring."""
    engine, client = trainer.engine, trainer.engine.basic_optimizer
    named = list(engine.module.named_parameters())
    params: dict[str, dict[str, torch.Tensor]] = {}
    steps = sorted({int(s["step"]) for s in client.state.values() if "step" in s})
    for name, param in named:
        if engine.optimizer is client:  # ZeRO-0: the module holds the fp32 weights, the optimizer whole moments
            state = client.state[param]
            params[name] = {"fp32": param.detach().float().clone(), "exp_avg": state["exp_avg"].clone(),
                            "exp_avg_sq": state["exp_avg_sq"].clone()}
        else:
            params[name] = {"fp32": safe_get_full_fp32_param(param).detach().cpu().clone(),
                            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg").detach().cpu().clone(),
                            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").detach().cpu().clone()}
    with full_parameters(engine) as whole:  # the compute-precision weights the forward pass uses
        for (name, _), param in zip(named, whole, strict=True):
            params[name]["module"] = param.detach().cpu().float().clone()
    scheduler = engine.lr_scheduler
    return {
        "params": params, "optimizer_steps": steps, "lrs": [g["lr"] for g in client.param_groups],
        "scheduler_last_epoch": scheduler.last_epoch, "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "trainer_state": trainer.state.state_dict(),
        "world_size": trainer.dist_info.world_size, "wrapper": type(engine.optimizer).__name__,
    }


class Snapshots(TrainingPlugin):
    """The snapshots of one run, taken by its `start_phase` (after any resume) and `after_step` hooks."""

    def __init__(self, steps: list[int], at_start: bool) -> None:
        self.steps, self.at_start = set(steps), at_start

    def _save(self, trainer: PhaseTrainer, label: str) -> None:
        taken = snapshot(trainer)
        if trainer.dist_info.rank == 0:
            torch.save(taken, trainer.run_dir / f"snapshot_{label}.pt")

    def start_phase(self, trainer: PhaseTrainer) -> None:
        if self.at_start:
            self._save(trainer, "start")

    def after_step(self, trainer: PhaseTrainer) -> None:
        if trainer.state.step in self.steps:
            self._save(trainer, str(trainer.state.step))


def run(plan_path: Path) -> None:
    outcomes: dict[str, int] = {}
    for entry in json.loads(plan_path.read_text()):
        snapshots = Snapshots(entry.get("snapshot_steps", []), entry.get("snapshot_start", False))
        rc = main(["--config", entry["config"], *entry.get("overrides", [])], [snapshots])
        outcomes[entry["name"]] = rc
        if dist.is_initialized():
            dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        plan_path.with_suffix(".outcomes.json").write_text(json.dumps(outcomes))


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    leave_without_teardown()
