"""The run-config keys the phase loop reads (pretrain/trainer.py, pretrain/optimizer_step.py), declared once, with
the checks of their values: the run config's sections inherit them (pretrain/config/sections.py), and the run plan
hands the loop the config's own section objects, typed as these declarations (pretrain/phase_state.py `LoopPlan`).

Torch-free and apart from the loop's modules, so that reading a config (the launcher, `--help`) loads no torch.
A new key the loop reads: its `setting` here, its check beside it, its use in the loop, and a test.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.errors import ConfigError
from pretrain.keys import SeedSection, setting

__all__ = ["FailureSection", "FeedSection", "LoopPhaseSection", "LoopRunSection", "ValidationSection"]


@dataclass
class LoopPhaseSection:
    """phaseN.<key>: how long the loop runs a phase."""

    steps: int = setting(0, "optimizer steps of this phase (required, > 0)")


@dataclass
class LoopRunSection(SeedSection):
    """run.<key>: this process's step budget; run.seed (the dropout reseed of every micro-batch) is the ground's."""

    stop_after_steps: int | None = setting(
        None,
        "checkpoint and exit 0 after this many optimizer steps of this process; rerun the same command to "
        "continue (null: run to the end)",
    )

    def check_stop(self) -> None:
        if self.stop_after_steps is not None and self.stop_after_steps <= 0:
            raise ConfigError(f"run.stop_after_steps: must be > 0, got {self.stop_after_steps}")


@dataclass
class ValidationSection:
    """logging.<key>: rank 0's progress bar and the held-out evaluations."""

    progress_bar: bool = setting(True, "a progress bar with ETA on rank 0's console")
    val_every_steps: int = setting(
        500,
        "optimizer steps between evaluations on the held-out shards (and one at each phase end); 0: never",
    )
    val_batches: int = setting(8, "micro-batches per rank per evaluation, when val_instances is unset")
    val_instances: int | None = setting(
        None,
        "held-out instances per evaluation (the first ones, the same at any world size and split); null: "
        "val_batches micro-batches per rank, whose count depends on the job's shape",
    )

    def check_validation(self) -> None:
        if self.val_instances is not None and self.val_instances < 1:
            raise ConfigError(f"logging.val_instances: must be >= 1, got {self.val_instances}")


@dataclass
class FailureSection:
    """When non-finite losses end the run."""

    max_consecutive_nonfinite: int = setting(
        5,
        "stop with exit code 3 (after a checkpoint) after this many optimizer steps in a row with a NaN/inf "
        "loss",
    )

    def check_failures(self) -> None:
        if self.max_consecutive_nonfinite < 1:
            raise ConfigError("failures.max_consecutive_nonfinite: must be >= 1")


@dataclass
class FeedSection:
    """data.<key>: the workers that read the step's micro-batches ahead (pretrain/step_feed.py)."""

    num_workers: int = setting(2, "DataLoader worker processes per rank")

    def check_feed(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers: must be >= 0, got {self.num_workers}")
