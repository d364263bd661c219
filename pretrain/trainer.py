"""One phase of pretraining: `PhaseTrainer.train`, the loop (steps, validation, checkpoints, stop and NaN handling).

The loop is split by what it does: this module is the loop; one optimizer step (micro-batches, loss
normalisation, the step's one all-reduce) is pretrain/optimizer_step.py, which `PhaseTrainer` derives from; the
step's micro-batches, read one step ahead, are pretrain/step_feed.py; what the loop is handed and keeps
(`LoopPlan`, `TrainerJob`, `PhaseState`) is pretrain/phase_state.py, re-exported here.

The trainer owns no framework coupling: it calls the engine object (`engine(**batch)`,
`engine.backward`, `engine.step`, checkpoints through `CheckpointManager`). Everything a resume
needs is in `PhaseState` (+ what DeepSpeed saves: weights, optimizer, lr-scheduler position).

Extension points: the job's `TrainingPlugin`, whose hooks pretrain/plugin.py writes out as the loop they
sit in, and the step monitors of its settings (what a step logs beyond losses and rates, pretrain/metrics/monitor_contract.py).
The trainer knows no plug-in or monitor by name and never sees the run config: it reads its `LoopPlan`,
which the run plan (pretrain/plan/run_plan.py) builds per phase.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from pretrain.checkpointing.cadence import SAVE_SECONDS_TAG, CheckpointCadence
from pretrain.checkpointing.layout import make_tag
from pretrain.data.batches import RankBatches, ValidationBatches
from pretrain.data.loader import model_inputs
from pretrain.keys import PHASE_NAMES
from pretrain.metrics.monitor_contract import attach_all
from pretrain.metrics.throughput import Throughput
from pretrain.model.bert import PretrainingOutput
from pretrain.optimizer_step import OptimizerStep
from pretrain.phase_state import (
    LoopPlan,
    NonFiniteLossError,
    PhaseState,
    TrainerJob,
    settle_batch_ramp,
)
from pretrain.step_feed import StepFeed
from pretrain.step_stats import StepResult

__all__ = ["NonFiniteLossError", "PhaseState", "PhaseTrainer", "TrainerJob", "LoopPlan"]


class PhaseTrainer(OptimizerStep):
    """One phase: the loop over its optimizer steps (`train`), with validation, checkpoints and the stop and NaN
    rules; each step is `OptimizerStep.train_step`."""

    def __init__(
        self,
        job: TrainerJob,
        settings: LoopPlan,
        engine: Any,
        train_batches: RankBatches,
        val_batches: RankBatches | None,
        throughput: Throughput,
        state: PhaseState,
    ) -> None:
        self.job = job
        self.settings = settings  # everything the loop uses of the run config, from the phase's plan
        self.resolved_config = job.resolved_config
        self.dist_info = job.dist_info
        self.run_dir = job.run_dir
        self.engine = engine
        self.train_batches = train_batches
        self.val_batches = val_batches
        self.checkpoints = job.checkpoints
        self.metrics = job.metrics
        self.throughput = throughput
        self.state = state
        self.stop = job.stop
        self.plugin = job.plugin
        self.loss_term = self.plugin.loss_term()  # added to every micro-batch's task loss
        # The ranks holding this model's replicas, over which statistics are averaged (None: the world).
        self.replica_group = self.plugin.replica_group
        self.monitors = attach_all(settings.monitors, engine)  # this trainer's own, on its engine
        self.accumulation = engine.gradient_accumulation_steps()
        self.global_batch = engine.train_batch_size()
        self.micro_batches_per_step = self.global_batch // engine.train_micro_batch_size_per_gpu()
        self.round_samples = self.global_batch // self.accumulation  # one micro-batch on every rank
        self.settings = settings = settle_batch_ramp(settings, state, self.round_samples)  # the warmup it started with
        train_batches.schedules = settings.schedules  # the stream masks each step at the rate of that clock
        self.ramp = None if settings.schedules is None else settings.schedules.clock.ramp
        self.shape_step(state.step)  # a batch warmup's shape of the step the phase (re)starts at
        train_batches.phase_index = PHASE_NAMES.index(state.phase)  # masks differ between phases
        train_batches.use_order(state.data_permutation)  # the order this phase's data position counts in
        if val_batches is not None:
            val_batches.phase_index = train_batches.phase_index
        self.steps_this_process = 0
        self.watch = job.watch  # the loop reads no job field
        self.cadence = CheckpointCadence(self.settings.checkpoint, started=time.monotonic())
        self.feed = StepFeed(train_batches, settings.feed.num_workers)  # the step's micro-batches, read a step ahead

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

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
        wanted = self.settings.validation.val_instances
        if wanted is None:
            wanted = self.settings.validation.val_batches * self.val_batches.micro_batch * self.val_batches.world_size
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
        budget = self.settings.run.stop_after_steps
        if result.stop_requested:
            return self.stop.signal_name or "signal on another rank"
        if budget is not None and self.steps_this_process >= budget:
            return f"run.stop_after_steps={budget}"
        return None

    def train(self, progress: Any | None = None) -> str:
        """Run to the end of the phase. Returns 'complete' or the reason it stopped early (after a checkpoint)."""
        val_every = self.settings.validation.val_every_steps
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
            if self.state.consecutive_nonfinite >= self.settings.failures.max_consecutive_nonfinite:
                self.save()
                raise NonFiniteLossError(
                    f"{self.state.consecutive_nonfinite} optimizer steps in a row had a NaN/inf loss "
                    f"({self.state.phase} step {self.state.step}); checkpoint written, stopping "
                    f"(failures.max_consecutive_nonfinite={self.settings.failures.max_consecutive_nonfinite})"
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
