"""Launched by tests/codistill/test_multirank.py: real runs of `pretrain.train.main` with codistillation.

    python codistill_scenarios.py SCENARIO WORKDIR     (SCENARIO: two | four | job0 | job1 | job0x2 | job1x2 | crash)

Every run records, on each rank, its own flat weights after every optimizer step and the teachers'
flat weights whenever a refresh happened (files in <run dir>/record/), so the test can compare
weights across runs and against the other group, bit for bit. job0 and job1 are the two groups of
one codistillation run as separate single-process jobs, meeting only through files: they must run
at the same time; each first runs its group's solo twin on 1 process (solo1_g<group>), so the twins cost no
interpreter of their own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain.codistill.codistillation import Codistillation
from pretrain.codistill.teacher import flat_weights
from pretrain.train import main
from pretrain.trainer import PhaseTrainer
from tests.support.extensions import AddedLoss, AfterEachStep
from tests.support.launching import leave_without_teardown
from tests.support.pretrain_fixtures import tiny_run_config

BASE_SEED = 7
CODISTILL_FULL = {"enabled": True, "groups": 2, "alpha": 1.0, "burn_in_steps": 2, "refresh_every": 4,
                  "temperature": 2.0, "loss": "kl", "targets": ["mlm", "nsp"], "exchange": "collective"}


def recorder(out: Path, group_size: int):
    """After-step probe: own weights every step; the teachers whenever a new refresh happened."""
    seen = {"refreshes": 0}

    def callback(trainer: PhaseTrainer) -> None:
        group, group_rank = divmod(dist.get_rank(), group_size)
        codistill = trainer.plugin.configured  # the run config's plug-in (PluginStack)
        if isinstance(codistill, Codistillation):  # separate jobs: group from the config
            layout = codistill.layout
            group, group_rank = layout.group, layout.group_rank
        step = trainer.global_step
        out.mkdir(parents=True, exist_ok=True)
        own = flat_weights(trainer.engine).clone()  # collective inside the group under ZeRO-3
        if group_rank == 0:
            torch.save(own, out / f"own_g{group}_s{step}.pt")
        if trainer.state.phase == "phase1" and trainer.state.step == trainer.settings.steps:
            # every training instance this rank read in phase 1 (the test checks the groups' are disjoint)
            batches = trainer.train_batches
            read = {index for k in range(trainer.state.step * trainer.accumulation)
                    for _, index in batches.stream_instances(
                        (k * batches.world_size + batches.rank) * batches.micro_batch, batches.micro_batch)}
            (out / f"read_g{group}r{group_rank}.json").write_text(json.dumps(sorted(read)))
        if isinstance(codistill, Codistillation):
            if len(codistill.refresh_log) > seen["refreshes"]:
                seen["refreshes"] = len(codistill.refresh_log)
                name = f"teacher_g{group}r{group_rank}_at{codistill.refresh_log[-1]}.pt"
                torch.save(codistill.state_dict(), out / name)
            if trainer.state.step == trainer.settings.steps:  # each phase end; the last one writes it whole
                (out / f"refresh_log_g{group}r{group_rank}.json").write_text(json.dumps(codistill.refresh_log))

    return callback


def write_config(workdir: Path, name: str, *, phases: list[str], phase1: int, phase2: int = 2,
                 codistill: dict[str, Any] | None = None, seed: int = BASE_SEED,
                 ds_overrides: dict[str, Any] | None = None, data_part: tuple[int, int] = (0, 1),
                 run_name: str | None = None, failures: int | None = None, export: bool = False) -> tuple[Path, Path]:
    """`export`: the phase-end Hugging Face exports, for the runs whose exports a test reads (co2_full, sep): each
    costs rank 0 a save and a reload (the other ranks wait), and the other runs' exports were never read."""
    run_dir = workdir / (run_name or name)
    # one file per rank and job: ranks and jobs write their configs at the same time
    rank = os.environ.get("RANK", "0")
    path = tiny_run_config(workdir / f"{name}.rank{rank}.json", workdir / "shards", run_dir, phase1=phase1,
                           phase2=phase2)
    config = json.loads(path.read_text(encoding="utf-8"))
    config["run"].update({"phases": phases, "seed": seed})
    config["data"].update({"part": data_part[0], "num_parts": data_part[1]})
    config["phase1"]["ds_overrides"] = ds_overrides or {}
    config["checkpoint"]["export_at_phase_end"] = export
    if failures is not None:
        config["failures"] = {"max_consecutive_nonfinite": failures}
    if codistill is not None:
        config["codistill"] = codistill
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path, run_dir


def run(workdir: Path, name: str, group_size: int, extra_args: list[str] | None = None, expect_code: int = 0,
        extra_loss: Any = None, **kwargs: Any) -> None:
    path, run_dir = write_config(workdir, name, **kwargs)
    extensions = [AfterEachStep(recorder(run_dir / "record", group_size)), *([AddedLoss(extra_loss)] if extra_loss else [])]
    code = main(["--config", str(path), *(extra_args or [])], extensions=extensions)
    if code != expect_code:
        raise SystemExit(f"{name}: exit code {code}, expected {expect_code}")


def solo_run(workdir: Path, world: int, group: int) -> None:
    """A group's twin: the single-model driver with the group's seed and data part, on group-size ranks."""
    run(workdir, f"solo{world}_g{group}", world, phases=["phase1"], phase1=5, seed=BASE_SEED + group,
        data_part=(group, 2))


def solo_runs(workdir: Path, world: int) -> None:
    for group in range(2):
        solo_run(workdir, world, group)


def nan_in_group_one(group_size: int, from_step: int):
    """Added loss term: a NaN loss on group 1's ranks from phase step `from_step` on; group 0 stays finite."""
    def extra_loss(output: Any, batch: Any, state: Any) -> tuple[torch.Tensor, dict]:
        bad = dist.get_rank() // group_size == 1 and state.step >= from_step
        return output.loss * (float("nan") if bad else 0.0), {}  # through the graph: NaN gradients too

    return extra_loss


def scenario_two(workdir: Path) -> None:
    """2 ranks: solo twins for the 4-rank job, then 2 groups x 1 rank."""
    solo_runs(workdir, 2)
    alpha0 = {**CODISTILL_FULL, "alpha": 0.0, "targets": ["mlm"]}
    run(workdir, "co2_alpha0", 1, phases=["phase1"], phase1=5, codistill=alpha0)
    both = ["phase1", "phase2"]
    run(workdir, "co2_full", 1, phases=both, phase1=7, codistill=CODISTILL_FULL, export=True)
    # Interrupted after 3 steps and rerun with the same command: must end where co2_full ended.
    run(workdir, "co2_resume", 1, ["--run.stop_after_steps=3"], phases=both, phase1=7, codistill=CODISTILL_FULL)
    run(workdir, "co2_resume", 1, phases=both, phase1=7, codistill=CODISTILL_FULL)
    # Teachers through published files instead of the all-gather: the same teachers, the same weights.
    files = {**CODISTILL_FULL, "exchange": "filesystem"}
    run(workdir, "co2_files", 1, phases=both, phase1=7, codistill=files)
    # ZeRO-3: the module's parameters are partitioned; the exchange gathers them.
    refresh = {**CODISTILL_FULL, "refresh_every": 2}
    run(workdir, "co2_zero3", 1, phases=["phase1"], phase1=5, codistill=refresh,
        ds_overrides={"zero_optimization": {"stage": 3}})
    # bf16 (DeepSpeed's bf16 optimizer on CPU): teachers in the compute dtype, refreshed with bf16 weights
    run(workdir, "co2_bf16", 1, ["--run.precision=bf16"], phases=["phase1"], phase1=4,
        codistill={**CODISTILL_FULL, "refresh_every": 2})
    # Group 1 diverges (NaN from step 3, abort after 2 in a row): both groups checkpoint and stop together.
    run(workdir, "co2_nan", 1, expect_code=3, extra_loss=nan_in_group_one(1, 3), phases=["phase1"], phase1=7,
        codistill=CODISTILL_FULL, failures=2)


def scenario_four(workdir: Path) -> None:
    """4 ranks: 2 groups x 2 ranks with ZeRO-2 partitions inside each group."""
    alpha0 = {**CODISTILL_FULL, "alpha": 0.0, "targets": ["mlm"]}
    run(workdir, "co4_alpha0", 2, phases=["phase1"], phase1=5, codistill=alpha0)
    refresh = {**CODISTILL_FULL, "refresh_every": 2}
    run(workdir, "co4_refresh", 2, phases=["phase1"], phase1=5, codistill=refresh)
    # through files: each group's first rank reads them and broadcasts the teachers to its group
    run(workdir, "co4_files", 2, phases=["phase1"], phase1=5, codistill={**refresh, "exchange": "filesystem"})


def scenario_crash(workdir: Path) -> None:
    """Group 1's rank raises at step 3 while group 0 trains on: the launcher must end the whole job."""
    def extra_loss(output: Any, batch: Any, state: Any) -> tuple[torch.Tensor, dict]:
        if dist.get_rank() == 1 and state.step >= 3:
            raise RuntimeError("injected crash in group 1")
        return output.loss * 0.0, {}

    run(workdir, "co2_crash", 1, extra_loss=extra_loss, phases=["phase1"], phase1=7, codistill=CODISTILL_FULL)


def separate_job_of_two_ranks(workdir: Path, group: int) -> None:
    """The same as separate jobs of 2 ranks each, distilling (alpha 1): a group's first rank reads the files
    and hands the weights and its verdicts to the other rank."""
    files = {**CODISTILL_FULL, "refresh_every": 2, "exchange": "filesystem", "exchange_timeout_s": 300.0}
    run(workdir, f"sepx2_job{group}", 2, [f"--codistill.group={group}"], run_name="sepx2", phases=["phase1"],
        phase1=5, codistill=files)


def separate_job(workdir: Path, group: int) -> None:
    """One group of a 2-group run as a job of its own (one process); alpha 0, so it must equal its solo twin, which
    this process runs first (the plain run before the codistillation, as the 2-rank job orders them)."""
    solo_run(workdir, 1, group)
    files = {**CODISTILL_FULL, "alpha": 0.0, "targets": ["mlm"], "refresh_every": 2, "exchange": "filesystem",
             "exchange_timeout_s": 300.0}
    run(workdir, f"sep_job{group}", 1, [f"--codistill.group={group}"], run_name="sep", phases=["phase1"], phase1=5,
        codistill=files, export=True)


SCENARIOS = {"two": scenario_two, "four": scenario_four, "crash": scenario_crash,
             "job0": lambda workdir: separate_job(workdir, 0), "job1": lambda workdir: separate_job(workdir, 1),
             "job0x2": lambda workdir: separate_job_of_two_ranks(workdir, 0),
             "job1x2": lambda workdir: separate_job_of_two_ranks(workdir, 1)}

if __name__ == "__main__":
    scenario, workdir = sys.argv[1:]
    SCENARIOS[scenario](Path(workdir))
    leave_without_teardown()
