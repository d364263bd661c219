"""One phase of pretraining: `train_step` (one optimizer step) and `train` (the loop), with state.

The trainer owns no framework coupling: it calls the engine object (`engine(**batch)`,
`engine.backward`, `engine.step`, checkpoints through `CheckpointManager`). Everything a resume
needs is in `PhaseState` (+ what DeepSpeed saves: weights, optimizer, lr-scheduler position).

Determinism: before every micro-batch the global torch RNG (dropout) is reseeded from (run seed,
phase, step, micro-batch, rank), so the random stream after a resume is the one an uninterrupted
run would have drawn, with no RNG bookkeeping in the loop.

Loss normalisation, independent of the split: the MLM loss of a step is the cross-entropy summed over
every labelled token of the global batch divided by their number, whatever the micro-batch size,
accumulation and world size. Each micro-batch contributes its summed cross-entropy times
(micro-batches per step / labelled tokens of the step); DeepSpeed's averaging over the accumulation
steps and ranks divides the factor back out. The step's labelled count needs one small all-reduce
before the first backward (all micro-batches of the step are read first). The NSP loss stays a mean
per micro-batch: every micro-batch holds the same number of instances, so the mean of the means is
the mean over the global batch.

Extension points: the job's `TrainingPlugin`, whose hooks pretrain/plugin.py writes out as the loop they
sit in, and the step monitors of its settings (what a step logs beyond losses and rates, pretrain/metrics/monitor.py).
The trainer knows no plug-in or monitor by name and never sees the run config: it reads its `TrainerSettings`
(below), which the run plan (pretrain/plan/run_plan.py) builds per phase.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from pretrain.checkpointing.cadence import SAVE_SECONDS_TAG, CadenceSettings, CheckpointCadence
from pretrain.checkpointing.layout import make_tag
from pretrain.config.sections import PHASE_NAMES
from pretrain.data.batches import RankBatches, ValidationBatches
from pretrain.data.loader import model_inputs, stream_batches
from pretrain.data.order import FEISTEL_ORDER, LEGACY_ORDER
from pretrain.distributed.info import DistInfo
from pretrain.distributed.step_watch import StepWatch
from pretrain.distributed.stop_request import StopRequest
from pretrain.metrics.monitor import StepMonitor, attach_all
from pretrain.metrics.throughput import Throughput
from pretrain.metrics.writer import MetricsWriter
from pretrain.model.bert import PretrainingOutput
from pretrain.model.compiled import CompileLedger
from pretrain.plugin import ExtraLoss, StepAgreement, TrainingPlugin
from pretrain.step_stats import StepResult, StepSums, host_values_to_device, labelled_slots

if TYPE_CHECKING:  # a type only: importing the checkpoint module would load DeepSpeed
    from pretrain.checkpointing.checkpoint import CheckpointManager

__all__ = ["NonFiniteLossError", "PhaseState", "PhaseTrainer", "TrainerJob", "TrainerSettings"]


@dataclass(frozen=True)
class TrainerSettings:
    """What one phase's trainer reads, and nothing else of the run config: the run plan builds it per phase
    (pretrain/plan/run_plan.py), so what a phase's loop depends on is listed here and a test or benchmark can
    make one without a whole config."""

    phase: str  # phase1 | phase2
    steps: int  # phaseN.steps: optimizer steps of the phase
    seq_len: int  # phaseN.seq_len
    seed: int  # run.seed: the dropout reseed before every micro-batch
    num_workers: int = 0  # data.num_workers: DataLoader worker processes of the training stream
    val_every_steps: int = 0  # logging.val_every_steps: steps between evaluations (0: never)
    val_instances: int | None = None  # logging.val_instances: held-out instances per evaluation (None: val_batches)
    val_batches: int = 1  # logging.val_batches: micro-batches per rank per evaluation when val_instances is None
    checkpoint: CadenceSettings = field(default_factory=CadenceSettings)  # checkpoint.every_*: when steps save
    max_consecutive_nonfinite: int = 5  # failures.max_consecutive_nonfinite: NaN/inf steps in a row before the abort
    stop_after_steps: int | None = None  # run.stop_after_steps: this process's step budget (None: to the end)
    step_offset: int = 0  # global step of the phase's step 0 on the TensorBoard axis (phase 2: phase 1's steps)
    progress_bar: bool = False  # logging.progress_bar: rank 0's bar with ETA
    nsp: bool = True  # the shards' objective: MLM + NSP (sentence pairs), else MLM alone (no NSP numbers logged)
    monitors: tuple[StepMonitor, ...] = ()  # what a step logs beyond losses and rates (pretrain/metrics/monitors.py)


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

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PhaseState:
        return cls(**{"data_order": 1, "data_permutation": LEGACY_ORDER, **data})


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
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


class PhaseTrainer:
    def __init__(
        self,
        job: TrainerJob,
        settings: TrainerSettings,
        engine: Any,
        train_batches: RankBatches,
        val_batches: RankBatches | None,
        throughput: Throughput,
        state: PhaseState,
    ) -> None:
        self.job = job
        self.settings = settings  # everything the loop uses of the run config, from the phase's plan
        self.resolved_config, self.dist_info, self.run_dir = job.resolved_config, job.dist_info, job.run_dir
        self.engine, self.train_batches, self.val_batches = engine, train_batches, val_batches
        self.checkpoints, self.metrics, self.throughput = job.checkpoints, job.metrics, throughput
        self.state, self.stop, self.plugin = state, job.stop, job.plugin
        self.loss_term: ExtraLoss | None = self.plugin.loss_term()  # added to every micro-batch's task loss
        # The ranks holding this model's replicas, over which statistics are averaged (None: the world).
        self.replica_group = self.plugin.replica_group
        self.monitors = attach_all(settings.monitors, engine)  # this trainer's own, on its engine
        self.accumulation = engine.gradient_accumulation_steps()
        self.global_batch = engine.train_batch_size()
        self.micro_batches_per_step = self.global_batch // engine.train_micro_batch_size_per_gpu()
        train_batches.phase_index = PHASE_NAMES.index(state.phase)  # masks differ between phases
        train_batches.use_order(state.data_permutation)  # the order this phase's data position counts in
        if val_batches is not None:
            val_batches.phase_index = train_batches.phase_index
        self.steps_this_process, self.watch = 0, job.watch  # the loop reads no job field
        self.cadence = CheckpointCadence(self.settings.checkpoint, started=time.monotonic())
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None
        self._ahead: list[dict[str, torch.Tensor]] = []  # micro-batches of the next step, read during this one
        self._data_wait_s = 0.0  # seconds this step waited for the loader

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    # ------------------------------------------------------------------ one optimizer step
    def _next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch of this rank's stream, on the host; the time the loop waits for it is logged."""
        if self._batches is None:
            per_chunk = self.train_batches.micro_batch * self.train_batches.world_size
            if self.state.data_position % per_chunk:
                raise ValueError(f"data position {self.state.data_position} is not a whole number of micro-batches "
                                 f"of {per_chunk} samples over all ranks")
            self._batches = stream_batches(self.train_batches, self.state.data_position // per_chunk,
                                           self.settings.num_workers)
        started = time.perf_counter()
        batch = next(self._batches)
        self._data_wait_s += time.perf_counter() - started
        return batch

    def _batches_of_step(self) -> list[dict[str, torch.Tensor]]:
        """This step's micro-batches: read during the previous step (`_read_ahead`), or now for the first step
        of this process (or phase). The loss normalisation needs every label of the step before its first
        backward, so a step's batches are read one step early, while the device computes the previous one."""
        batches, self._ahead = self._ahead, []
        while len(batches) < self.accumulation:
            batches.append(self._next_batch())
        return batches

    def _read_ahead(self) -> None:
        """Read one micro-batch of the next step (called after each micro-batch's work is queued)."""
        if self.state.step + 1 < self.settings.steps and len(self._ahead) < self.accumulation:
            self._ahead.append(self._next_batch())

    def loss(
        self, output: PretrainingOutput, batch: dict[str, torch.Tensor], mlm_scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """What backward runs on. `mlm_scale` = micro-batches per step / labelled tokens of the step: the MLM
        term becomes split-independent (module docstring); None keeps the micro-batch mean."""
        task = output.loss if mlm_scale is None else output.mlm_loss_sum * mlm_scale.float() + output.nsp_loss
        if self.loss_term is None:
            return task, {}
        extra, numbers = self.loss_term(output, batch, self.state)
        return task + extra, numbers

    def _step_mlm_scale(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """micro-batches per step / labelled MLM slots of the whole global batch (one tiny all-reduce of a
        number counted on the host from the collated labels: no device -> host sync)."""
        labelled = host_values_to_device([float(sum(labelled_slots(b) for b in batches))], self.dist_info.device)
        if dist.is_initialized() and self.dist_info.world_size > 1:
            dist.all_reduce(labelled, group=self.replica_group)
        return self.micro_batches_per_step / labelled[0].clamp_min(1)

    def train_step(self) -> StepResult:
        """Accumulate `gradient_accumulation_steps` micro-batches, then one optimizer step.

        Statistics stay on the device until one all-reduce at the end (a single host sync per step,
        pretrain/step_stats.py), which also carries this rank's stop request so the ranks agree on stopping
        for free, and the step's work counts, so throughput counts every rank's batches. While each
        micro-batch's work is queued, one micro-batch of the next step is read.
        """
        phase_index = PHASE_NAMES.index(self.state.phase)
        self._data_wait_s = 0.0
        batches = self._batches_of_step()
        self.state.data_position += self.global_batch
        mlm_scale = self._step_mlm_scale(batches)  # before the first backward (module docstring)
        sums = StepSums(self.dist_info.device)
        lr = 0.0
        for micro, host_batch in enumerate(batches):
            batch = model_inputs(host_batch, self.dist_info.device)
            torch.manual_seed(step_seed(self.settings.seed, phase_index, self.state.step, micro, self.dist_info.rank))
            output: PretrainingOutput = self.engine(**batch)
            loss, extra = self.loss(output, batch, mlm_scale)
            # A NaN/inf loss is still back-propagated: its non-finite gradients make DeepSpeed's overflow
            # check skip the step on every rank together (checked below), so no rank diverges.
            self.engine.backward(loss)
            if micro == self.accumulation - 1:
                # the lr this update uses: DeepSpeed steps its scheduler inside the boundary engine.step()
                lr = float(self.engine.get_lr()[0])
                for monitor in self.monitors:  # the step's gradients: averaged over the ranks, not yet clipped
                    monitor.before_step()
            self.engine.step()
            sums.add(output, batch, host_batch, loss, extra)
            self._read_ahead()
        totals = sums.reduce(bool(self.stop.signal_name), self.cadence.time_due(time.monotonic()),
                             self.replica_group, self.dist_info.world_size)
        nonfinite = totals["nonfinite"]
        counts = totals.counts()
        aborting_here = bool(nonfinite) and (
            self.state.consecutive_nonfinite + 1 >= self.settings.max_consecutive_nonfinite)
        # a plug-in that runs several models in one job makes the stop and a NaN abort common to all of them
        agreed, abort_elsewhere = self.plugin.agree_on_step(
            StepAgreement(stop=totals["stop"] > 0, save_due=totals["save_due"] > 0, aborting_here=aborting_here),
            self.dist_info.device)
        finite_micro = self.accumulation * self.dist_info.world_size - nonfinite
        applied = bool(self.engine.was_step_applied())
        if nonfinite and applied:
            raise NonFiniteLossError(
                "a NaN/inf loss reached an applied optimizer step: this engine configuration does not check "
                "gradients for overflow (use ZeRO stage >= 1 or fp16); stopping before the weights are used"
            )
        labelled = max(totals["mlm_labelled"], 1)
        values = {
            "loss/mlm": totals["mlm_loss_sum"] / labelled,  # over every labelled token of the step (NaN ones: 0)
            "acc/mlm": totals["mlm_correct"] / labelled,
        }
        if self.settings.nsp:
            values["loss/nsp"] = totals["nsp_loss_sum"] / max(finite_micro, 1)
            values["acc/nsp"] = totals["nsp_correct"] / max(totals["instances"], 1)
        values["loss/total"] = values["loss/mlm"] + values.get("loss/nsp", 0.0)
        divisor = self.accumulation * self.dist_info.world_size
        values.update({key: total / divisor for key, total in totals.extras.items()})
        values["lr"] = lr
        values["perf/data_wait_s"] = self._data_wait_s
        return StepResult(applied=applied, nonfinite=nonfinite > 0, values=values, counts=counts,
                          stop_requested=agreed.stop, save_due=agreed.save_due, abort_elsewhere=abort_elsewhere)

    # ------------------------------------------------------------------ loop
    def step_metrics(self, result: StepResult) -> dict[str, float]:
        values = dict(result.values)
        wrapper = self.engine.optimizer
        values["loss_scale"] = float(getattr(wrapper, "cur_scale", getattr(wrapper, "loss_scale", 1.0)) or 1.0)
        values["failures/nonfinite_steps"] = float(self.state.nonfinite_steps)
        values["failures/skipped_steps"] = float(self.engine.skipped_steps)
        values.update(self.throughput.step(result.counts))  # rows for device work, instances for useful work
        for monitor in self.monitors:  # after the step's host read: a device number read here waits for nothing
            values.update(monitor.values(result))
        return values

    def log_step(self, values: dict[str, float]) -> None:
        for monitor in self.monitors:
            for tag, tensor in monitor.histograms().items():
                self.metrics.histogram(self.global_step, tag, tensor)
        self.metrics.scalars(self.global_step, values, extra={"phase": self.state.phase, "phase_step": self.state.step,
                                                              "samples": self.state.samples_seen})

    @property
    def global_step(self) -> int:
        """TensorBoard x-axis: phase 2 continues after phase 1's steps."""
        return self.settings.step_offset + self.state.step

    def held_out_batches(self) -> ValidationBatches | None:
        """One evaluation's held-out micro-batches of this rank: `val_instances` instances (the same ones at any
        world size), else `val_batches` micro-batches per rank. None: no held-out data this phase."""
        if self.val_batches is None:
            return None
        wanted = self.settings.val_instances
        if wanted is None:
            wanted = self.settings.val_batches * self.val_batches.micro_batch * self.val_batches.world_size
        return ValidationBatches(self.val_batches, wanted)

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        held_out = self.held_out_batches()
        if held_out is None:
            return {}
        self.engine.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.dist_info.device)  # loss sum, correct, labelled
        for batch in held_out:
            output: PretrainingOutput = self.engine(**model_inputs(batch, self.dist_info.device))
            correct, n = output.mlm_counts()  # labelled slots only
            sums += torch.stack([output.mlm_loss_sum.double(), correct.double(), n.double()])
        self.engine.train()
        if dist.is_initialized() and dist.get_world_size(self.replica_group) > 1:
            dist.all_reduce(sums, group=self.replica_group)
        loss_sum, correct, n = sums.tolist()
        return {"val/mlm_loss": loss_sum / max(n, 1), "val/mlm_acc": correct / max(n, 1)}

    def save(self, phase_end: bool = False, routine: bool = False) -> None:
        started = time.monotonic()
        self.checkpoints.save(self.engine, make_tag(self.state.phase, self.state.step), self.state.state_dict(),
                              self.resolved_config, phase_end=phase_end, may_fail=routine)
        done = time.monotonic()
        self.cadence.saved(done)
        # what a save costs: the input of the checkpoint interval that fits a failure rate (checkpointing/cadence.py)
        self.metrics.scalars(self.global_step, {SAVE_SECONDS_TAG: done - started},
                             extra={"samples": self.state.samples_seen})

    def _stop_requested(self, result: StepResult) -> str | None:
        """Agreed across ranks: a signal on any rank (carried by the step's all-reduce), or the step budget."""
        budget = self.settings.stop_after_steps
        if result.stop_requested:
            return self.stop.signal_name or "signal on another rank"
        if budget is not None and self.steps_this_process >= budget:
            return f"run.stop_after_steps={budget}"
        return None

    def train(self, progress: Any | None = None) -> str:
        """Run to the end of the phase. Returns 'complete' or the reason it stopped early (after a checkpoint)."""
        val_every = self.settings.val_every_steps
        self.plugin.start_phase(self)  # after any resume, before the clocks start: its work is not training time
        self.throughput.restart()
        self.cadence.saved(time.monotonic())  # the minutes count from the phase's (re)start
        while self.state.step < self.settings.steps:
            self.watch.begin(self.state.phase, self.state.step + 1)  # held until the next step: see step_watch.py
            result = self.train_step()
            self.state.step += 1
            self.steps_this_process += 1
            if self.steps_this_process == 1:
                self.metrics.mark("first_step")  # the end of this process's start-up (the run clock)
            self.state.samples_seen += self.global_batch
            self.state.nonfinite_steps += int(result.nonfinite)
            self.state.consecutive_nonfinite = self.state.consecutive_nonfinite + 1 if result.nonfinite else 0
            values = self.step_metrics(result)
            if val_every and self.state.step % val_every == 0:
                values.update(self.validate())
            self.log_step(values)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{values['loss/total']:.4f}", lr=f"{values['lr']:.2e}", refresh=False)
            self.plugin.after_step(self)
            if result.abort_elsewhere:  # this model is fine, another part of the job reached the limit
                self.save()
                raise NonFiniteLossError(
                    f"{result.abort_elsewhere} ({self.state.phase} step {self.state.step}); checkpoint written")
            if self.state.consecutive_nonfinite >= self.settings.max_consecutive_nonfinite:
                self.save()
                raise NonFiniteLossError(
                    f"{self.state.consecutive_nonfinite} optimizer steps in a row had a NaN/inf loss "
                    f"({self.state.phase} step {self.state.step}); checkpoint written, stopping "
                    f"(failures.max_consecutive_nonfinite={self.settings.max_consecutive_nonfinite})"
                )
            if self.state.step >= self.settings.steps:
                break
            reason = self._stop_requested(result)
            if reason is not None:
                self.save()
                return reason
            if self.cadence.should_save(self.state.step, result.save_due):
                self.save(routine=True)  # a routine save may fail (full disk): training goes on (docs/faults.md)
                self.throughput.restart()  # checkpoint time is not training throughput
        self.state.complete = True
        if self.val_batches is not None and val_every and self.state.step % val_every:
            self.metrics.scalars(self.global_step, self.validate(), extra={"samples": self.state.samples_seen})
        self.save(phase_end=True)
        self.metrics.flush()
        return "complete"
