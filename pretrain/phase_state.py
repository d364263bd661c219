"""What one phase's loop is handed and what it keeps: its plan, the job it runs in, and its resumable state.

`LoopPlan` is what the run plan (pretrain/plan/run_plan.py) hands one phase's loop: the run config's sections
that the loop reads, as the config's own objects typed as the loop's declarations (pretrain/loop_sections.py,
pretrain/checkpointing/cadence.py), and what the plan derived (the step offset, the objective, the monitors, the
schedules); `TrainerJob` is what every phase of one job shares (the driver, pretrain/train.py, builds
it once); `PhaseState` is what a resume needs besides DeepSpeed's own files (weights, optimizer, the lr
scheduler's position), written with every checkpoint. Kept apart from the loop (pretrain/trainer.py) so that a
test, a benchmark or a plug-in can make and read them without the loop's imports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pretrain.checkpointing.cadence import CadenceSection
from pretrain.data.order import FEISTEL_ORDER, LEGACY_ORDER
from pretrain.distributed.info import DistInfo
from pretrain.distributed.step_watch import StepWatch
from pretrain.distributed.stop_request import StopRequest
from pretrain.errors import ConfigError
from pretrain.loop_sections import (
    FailureSection,
    FeedSection,
    LoopPhaseSection,
    LoopRunSection,
    ValidationSection,
)
from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.metrics.writer import MetricsWriter
from pretrain.model.compiled import CompileLedger
from pretrain.plugin import TrainingPlugin
from pretrain.schedules.batch import BatchRamp
from pretrain.schedules.phase import PhaseSchedules

if TYPE_CHECKING:  # a type only: importing the checkpoint module would load DeepSpeed
    from pretrain.checkpointing.checkpoint import CheckpointManager

__all__ = ["NonFiniteLossError", "PhaseState", "TrainerJob", "LoopPlan", "settle_batch_ramp", "step_seed"]


@dataclass(frozen=True)
class LoopPlan:
    """What one phase's loop reads, made by the run plan per phase; a test or benchmark makes one without a config
    (each section's defaults are the keys' own). The sections are the run config's instances, each typed as the
    declaration of what the loop reads of it; no key is copied here."""

    phase: str  # phase1 | phase2: the phase's name (its section is `section`)
    section: LoopPhaseSection = field(default_factory=LoopPhaseSection)  # phaseN: its steps
    run: LoopRunSection = field(default_factory=LoopRunSection)  # run: the seed of dropout, this process's budget
    validation: ValidationSection = field(default_factory=ValidationSection)  # logging: evaluations, the bar
    failures: FailureSection = field(default_factory=FailureSection)  # failures: the NaN/inf abort
    checkpoint: CadenceSection = field(default_factory=CadenceSection)  # checkpoint: when step checkpoints are due
    feed: FeedSection = field(default_factory=FeedSection)  # data: the feed's DataLoader workers
    step_offset: int = 0  # global step of the phase's step 0 on the TensorBoard axis (phase 2: phase 1's steps)
    nsp: bool = True  # the shards' objective: MLM + NSP (sentence pairs), else MLM alone (no NSP numbers logged)
    monitors: tuple[StepMonitor, ...] = ()  # what a step logs beyond losses and rates (pretrain/metrics/monitor_registry.py)
    schedules: PhaseSchedules | None = None  # the phase's clock and its schedules besides the lr (pretrain/schedules/)

    @property
    def steps(self) -> int:
        """The phase's optimizer steps (phaseN.steps)."""
        return self.section.steps


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/inf loss; a checkpoint was written first."""


@dataclass
class PhaseState:
    phase: str
    step: int = 0  # optimizer steps done in this phase (skipped ones included: their data was consumed)
    data_position: int = 0  # samples of this phase's data stream consumed by all ranks (step x global batch)
    samples_seen: int = 0  # sequences of the whole run (all phases, all ranks)
    nonfinite_steps: int = 0
    consecutive_nonfinite: int = 0
    complete: bool = False
    # 2: the data stream does not depend on the world size and data_position counts samples. States without
    # the key were written when data_position counted this rank's micro-batches (resumable on that world only).
    data_order: int = 2
    data_permutation: str = FEISTEL_ORDER  # pretrain/data/order.py; states without it resume on numpy's (legacy)
    # the batch warmup the phase started with (BatchRamp.record: its accumulation in that world's micro-batch
    # rounds), kept on any number of ranks; None: no warmup, or a state written before phases recorded it
    batch_ramp: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PhaseState:
        return cls(**{"data_order": 1, "data_permutation": LEGACY_ORDER, **data})


def settle_batch_ramp(settings: LoopPlan, state: PhaseState, round_samples: int) -> LoopPlan:
    """The settings a phase runs with on this world, whose micro-batch round (micro-batch x ranks) holds
    `round_samples` samples: under a batch warmup, the ramp the phase started with (recorded in `state` here at
    its start), so a resume on another number of ranks takes the same samples at every step; refused in one line
    where the stream position is not that ramp's, or a step left cannot be split into this world's rounds
    (pretrain/schedules/batch.py says why that cannot be made exact)."""
    schedules = settings.schedules
    if schedules is None or (schedules.clock.ramp is None and not state.batch_ramp):
        return settings
    ramp = BatchRamp(**state.batch_ramp) if state.batch_ramp else schedules.clock.ramp
    state.batch_ramp = ramp.record()
    clock = schedules.clock.with_ramp(ramp)
    where, expected = f"{state.phase}.batch_warmup_steps", clock.samples_before(state.step)
    if state.data_position != expected:
        raise ConfigError(
            f"{where}: the checkpoint is at sample {state.data_position:,} of {state.phase}, but the batch warmup "
            f"puts step {state.step} at {expected:,} (a checkpoint written before phases recorded their warmup "
            "resumes on the number of ranks that started it)")
    misfit = clock.first_misfit(state.step, state.data_position, round_samples)
    if misfit is not None:
        raise ConfigError(
            f"{where}: {misfit} under the warmup {state.phase} started with (rounds of "
            f"{clock.global_batch // ramp.accumulation} samples), not whole micro-batch rounds of this world "
            f"({round_samples} samples: micro-batch x ranks); resume on a number of ranks whose round divides it")
    return replace(settings, schedules=replace(schedules, clock=clock))


@dataclass
class TrainerJob:
    """What every phase of one job shares, built once by the driver (pretrain/train.py) and handed to each
    phase's trainer: this process's place in the job, the run folder, where checkpoints and metrics go, the
    stop request, and the job's plug-in (the driver's: a PluginStack of the config's plug-in and a caller's
    extensions). Each phase's own settings come from its plan."""

    run_dir: Path  # the job's run folder (a plug-in's share applied)
    resolved_config: dict[str, Any]  # the run config + what was derived from files, written with every checkpoint
    dist_info: DistInfo
    checkpoints: CheckpointManager
    metrics: MetricsWriter
    stop: StopRequest
    plugin: TrainingPlugin = field(default_factory=TrainingPlugin)
    watch: StepWatch = field(default_factory=StepWatch.from_env)  # progress timed by the elastic agent: hangs
    compile_ledger: CompileLedger = field(default_factory=CompileLedger)  # the compiled layer over the process


def step_seed(*parts: int) -> int:
    """The dropout seed of one micro-batch from (run seed, phase, step, micro-batch, rank): the random stream after
    a resume is the one an uninterrupted run would have drawn, with no RNG state to checkpoint."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)
