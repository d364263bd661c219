"""Launched on 2 CPU ranks by tests/config/test_recipes.py: a shipped recipe, shrunk, run as a user runs it.

    [pretrain WORK ...] [squad WORK]    each in turn, in this one launch (tests/config/test_recipes.py)

    pretrain WORK    WORK/run.json (pretrain.config.rehearsal's shrink of a shipped RUN.json):
                     A: every phase, SIGTERM to rank 1 after the last phase's step 1 (the ranks agree at step 2,
                        checkpoint, stop), then the same command again: resumes inside that phase and completes;
                     C: the last phase in one go, in its own folder: phase 2 alone from A's phase-1 export
                        (`phase2.init_from`), or a one-phase recipe from scratch.
                     Every step records the engine's optimizer wrapper, client optimizer and precision;
                     the last step of every phase saves the live fp32 master weights (what an export of
                     that phase must equal).
    squad WORK       fine-tunes WORK/export with every WORK/squad_*.json (shrunk shipped SQuAD JSONs), with the
                     precision and toy batch flags of its WORK/squad_*.meta.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

from pretrain.finetune.squad.__main__ import main as squad_main
from pretrain.train import main
from pretrain.trainer import PhaseTrainer
from tests.scripts.pretrain_scenarios import record, sigterm_rank1_after
from tests.support.extensions import after_each_step
from tests.support.launching import leave_without_teardown

SHORT_WINDOWS = ["--max-seq-length", "48", "--doc-stride", "20", "--max-query-length", "16"]


def record_paths(out: Path):
    """Which DeepSpeed path each phase really took (rank 0 writes)."""

    def callback(trainer: PhaseTrainer) -> None:
        if dist.get_rank() != 0:
            return
        engine = trainer.engine
        data = json.loads(out.read_text()) if out.exists() else {}
        data[trainer.state.phase] = {
            "wrapper": type(engine.optimizer).__name__,
            "client": type(engine.basic_optimizer).__name__,
            "bf16": bool(engine.bfloat16_enabled()),
            "fp16": bool(engine.fp16_enabled()),
            "zero_stage": int(engine.zero_optimization_stage()),
            "accumulation": int(engine.gradient_accumulation_steps()),
        }
        out.write_text(json.dumps(data))

    return callback


def save_masters(trainer: PhaseTrainer) -> None:
    """At a phase's last step: the fp32 masters behind the engine (collective within the model's ranks)."""
    if trainer.state.step != trainer.settings.steps:
        return
    masters = {name: safe_get_full_fp32_param(param).detach().cpu().clone()
               for name, param in trainer.engine.module.named_parameters()}
    if trainer.dist_info.rank == 0:
        torch.save(masters, trainer.run_dir / f"masters_{trainer.state.phase}.pt")


def pretrain(work: Path) -> None:
    config = work / "run.json"
    run = json.loads(config.read_text())
    a_dir = Path(run["run"]["dir"])
    phases = run["run"]["phases"]
    paths = record_paths(work / "paths_a.json")
    codistill = run.get("codistill", {}).get("enabled", False)
    first_model = a_dir / "group0" if codistill else a_dir
    rc = main(["--config", str(config)], after_each_step(paths, save_masters, sigterm_rank1_after(1, phases[-1])))
    record(work, "a_interrupted", rc)
    if dist.get_rank() == 0:
        record(work, "a_latest_after_stop", (first_model / "checkpoints" / "latest").read_text())
    rc = main(["--config", str(config)], after_each_step(paths, save_masters))
    record(work, "a_resumed", rc)
    # C: the last phase in one go, in its own folder: from A's phase-1 export (two phases), or from scratch (one)
    overrides = [f"--run.dir={work / 'c'}"]
    if len(phases) > 1:
        overrides += ['--run.phases=["phase2"]', f"--phase2.init_from={first_model / 'export' / 'phase1'}"]
    if codistill and run["codistill"].get("exchange_dir"):
        overrides.append(f"--codistill.exchange_dir={work / 'c_exchange'}")
    if not codistill:  # the test reads C's losses and paths; its export only for a codistillation recipe
        overrides.append("--checkpoint.export_at_phase_end=false")
    rc = main(["--config", str(config), *overrides], after_each_step(record_paths(work / "paths_c.json")))
    record(work, "c_last_phase_in_one_go", rc)


def squad(work: Path) -> None:
    for ds in sorted(work.glob("squad_*.json")):
        meta = json.loads(ds.with_suffix(".meta").read_text())
        code = squad_main(["finetune", "--model", str(work / "export"), "--train", str(work / "train.json"),
                           "--dev", str(work / "dev.json"), "--ds-config", str(ds), "--precision", meta["precision"],
                           *meta["flags"],
                           "--out", str(work / ds.stem), "--max-steps", "3", "--log-every", "1", *SHORT_WINDOWS,
                           "--allow-unk"])  # the rehearsal's toy vocab has none of SQuAD's words: mechanics only
        record(work, ds.stem, code)


def run(argv: list[str]) -> None:
    """`pretrain W1 W2 ... squad WS`: every work folder after a mode word runs in that mode, in order."""
    modes, mode = {"pretrain": pretrain, "squad": squad}, None
    for arg in argv:
        if arg in modes:
            mode = modes[arg]
        elif mode is None:
            raise SystemExit(f"{arg}: a work folder before any mode word (pretrain, squad)")
        else:
            mode(Path(arg))
            if dist.is_initialized():
                dist.barrier()


if __name__ == "__main__":
    run(sys.argv[1:])
    leave_without_teardown()
