"""The slice of the run config one phase's trainer reads, built once per phase (`TrainerSettings.from_config`).

The trainer (pretrain/trainer.py) reads these fields and nothing else of the RunConfig, so what a phase's
loop depends on is listed in one place and a test or benchmark can see it without a whole config. The
config it is built from is the job's (a plug-in's `JobShare` applied: its seed, folders and data part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pretrain.config.sections import CheckpointSection, PhaseSection, RunConfig


@dataclass(frozen=True)
class TrainerSettings:
    """What one phase's trainer reads of the run config."""

    phase: PhaseSection  # config.phase(name): steps, seq_len, packing, lr schedule, batch
    seed: int  # run.seed: the dropout reseed before every micro-batch
    num_workers: int  # data.num_workers: DataLoader worker processes of the training stream
    val_every_steps: int  # logging.val_every_steps: steps between evaluations (0: never)
    val_instances: int | None  # logging.val_instances: held-out instances per evaluation (None: val_batches)
    val_batches: int  # logging.val_batches: micro-batches per rank per evaluation when val_instances is None
    checkpoint: CheckpointSection  # when step checkpoints are due (every_steps, every_minutes)
    max_consecutive_nonfinite: int  # failures.max_consecutive_nonfinite: NaN/inf steps in a row before the abort
    stop_after_steps: int | None  # run.stop_after_steps: this process's step budget (None: to the end)
    step_offset: int  # global step of the phase's step 0 on the TensorBoard axis (phase 2: phase 1's steps)

    @classmethod
    def from_config(cls, config: RunConfig, phase_name: str) -> TrainerSettings:
        """The settings of phase `phase_name` of `config` (ConfigError: an unknown phase name)."""
        return cls(
            phase=config.phase(phase_name),
            seed=config.run.seed,
            num_workers=config.data.num_workers,
            val_every_steps=config.logging.val_every_steps,
            val_instances=config.logging.val_instances,
            val_batches=config.logging.val_batches,
            checkpoint=config.checkpoint,
            max_consecutive_nonfinite=config.failures.max_consecutive_nonfinite,
            stop_after_steps=config.run.stop_after_steps,
            step_offset=config.phase1.steps if phase_name == "phase2" else 0,
        )
