"""Launched on 2 CPU ranks by tests/pretrain/test_multirank.py: real runs of `pretrain.train.main`.

    first WORKDIR    R1: uninterrupted two-phase run; saves the engine's MLM logits on a fixed batch
                     at the last step. R2: the same config in another folder, SIGTERM delivered to
                     rank 1 only after phase-1 step 3 (the ranks must agree to stop and checkpoint).
                     R3: NaN losses injected through the extra-loss hook: skipped steps, then abort.
                     M (resume launch): MLM alone on packed shards, uninterrupted and stopped + resumed.
    shared WORKDIR   runA.json uninterrupted; runB.json stopped after 9 steps and rerun to the end.
    resume WORKDIR   R2 again with the same command: resumes by itself; then once more in-process with
                     run.stop_after_steps to stop inside phase 2, and a final rerun to completion.
                     R4: phase 2 only, initialised from R1's phase-1 export.

After "first" and "resume", rank 0 writes which `pretrain.codistill` modules the process loaded
(plugin_modules.json): plain runs must load none (codistillation is a plug-in, pretrain/plugin.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpointing.export import verification_batch
from pretrain.train import main
from pretrain.trainer import PhaseTrainer
from tests.support.extensions import AddedLoss, after_each_step
from tests.support.launching import leave_without_teardown


def save_engine_logits(out: Path):
    def callback(trainer: PhaseTrainer) -> None:
        if trainer.state.phase != "phase2" or trainer.state.step != trainer.settings.steps:
            return
        module = trainer.engine.module
        batch = verification_batch(module.config)
        was_training = module.training
        module.eval()
        with torch.no_grad():
            logits = module.dense_mlm_logits(**batch)
        module.train(was_training)
        if dist.get_rank() == 0:
            torch.save(logits, out)

    return callback


def sigterm_rank1_after(step: int, phase: str = "phase1"):
    """SIGTERM to rank 1 alone after `phase` step `step`: the ranks must agree to stop and checkpoint."""

    def callback(trainer: PhaseTrainer) -> None:
        if trainer.state.phase == phase and trainer.state.step == step and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    return callback


def nan_loss_at(steps: set[int]):
    """Added loss term that turns the task loss into NaN on the given (0-based) optimizer steps."""

    def extra_loss(output, batch, state):  # noqa: ANN001, ANN202 - the ExtraLoss signature
        if state.step in steps:
            return output.loss * float("nan"), {}
        return output.loss.new_zeros(()), {}

    return extra_loss


def weight_sums(out: Path):
    sums: list[float] = []

    def callback(trainer: PhaseTrainer) -> None:
        sums.append(float(trainer.engine.module.bert.embeddings.word_embeddings.weight.double().sum()))
        if dist.get_rank() == 0:
            out.write_text(json.dumps(sums))

    return callback


def record(workdir: Path, name: str, value: object) -> None:
    if dist.get_rank() == 0:
        path = workdir / "outcomes.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[name] = value
        path.write_text(json.dumps(data))


def record_plugin_modules(workdir: Path, mode: str) -> None:
    """The codistillation modules this process has loaded, after its plain runs: none expected."""
    if dist.get_rank() == 0:
        path = workdir / "plugin_modules.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[mode] = sorted(m for m in sys.modules if m.startswith("pretrain.codistill"))
        path.write_text(json.dumps(data))


def run(argv: list[str]) -> None:
    mode, workdir = argv[0], Path(argv[1])
    if mode == "first":
        rc = main(["--config", str(workdir / "run1.json")], after_each_step(save_engine_logits(workdir / "engine_logits.pt")))
        record(workdir, "r1", rc)
        rc = main(["--config", str(workdir / "run2.json")], after_each_step(sigterm_rank1_after(3)))
        record(workdir, "r2_interrupted", rc)
        # R3: NaN loss on optimizer steps 1 (alone) and 3, 4 (in a row) with max_consecutive_nonfinite=2
        rc = main(["--config", str(workdir / "run3.json"), "--run.phases=[\"phase1\"]",
                   "--failures.max_consecutive_nonfinite=2"],
                  [*after_each_step(weight_sums(workdir / "r3_weight_sums.json")), AddedLoss(nan_loss_at({1, 3, 4}))])
        record(workdir, "r3_nan", rc)
    elif mode == "resume":
        rc = main(["--config", str(workdir / "run2.json")] + ["--run.stop_after_steps=5"])
        record(workdir, "r2_resumed_until_phase2", rc)
        rc = main(["--config", str(workdir / "run2.json")])
        record(workdir, "r2_finished", rc)
        # R4: phase 2 alone, started from R1's exported phase-1 model
        rc = main(["--config", str(workdir / "run4.json"), '--run.phases=["phase2"]',
                   f"--phase2.init_from={workdir / 'r1' / 'export' / 'phase1'}"])
        record(workdir, "r4_phase2_from_export", rc)
        # M: MLM alone (packed full sentences, 30 % masking): A through both phases; B stopped by the step budget
        # inside phase 2 (a checkpoint there), then the same command again
        record(workdir, "mlm_a", main(["--config", str(workdir / "mlmA.json")]))
        record(workdir, "mlm_b_stopped", main(["--config", str(workdir / "mlmB.json"), "--run.stop_after_steps=8"]))
        record(workdir, "mlm_b_finished", main(["--config", str(workdir / "mlmB.json")]))
    elif mode == "shared":  # real shards: A uninterrupted; B stopped by the step budget, then rerun
        record(workdir, "a", main(["--config", str(workdir / "runA.json")]))
        record(workdir, "b_stopped", main(["--config", str(workdir / "runB.json"), "--run.stop_after_steps=9"]))
        record(workdir, "b_finished", main(["--config", str(workdir / "runB.json")]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    record_plugin_modules(workdir, mode)


if __name__ == "__main__":
    run(sys.argv[1:])
    leave_without_teardown()
