"""One optimizer step of a phase: its micro-batches through forward and backward, the loss, the step's numbers.

Determinism: before every micro-batch the global torch RNG (dropout) is reseeded from (run seed, phase, step,
micro-batch, rank) (`step_seed`, pretrain/phase_state.py), so the random stream after a resume is the one an
uninterrupted run would have drawn, with no RNG bookkeeping in the loop.

Loss normalisation, independent of the split: the MLM loss of a step is the cross-entropy summed over
every labelled token of the global batch divided by their number, whatever the micro-batch size,
accumulation and world size. Each micro-batch contributes its summed cross-entropy times
(micro-batches per step / labelled tokens of the step); DeepSpeed's averaging over the accumulation
steps and ranks divides the factor back out. The step's labelled count needs one small all-reduce
before the first backward (all micro-batches of the step are read first, pretrain/step_feed.py). The NSP
loss stays a mean per micro-batch: every micro-batch holds the same number of instances, so the mean of the
means is the mean over the global batch.

The step's shape: the phase's accumulation, or under a batch warmup (pretrain/schedules/batch.py) the ramp's for
this step, told to DeepSpeed before the step with the boundary marked on its last micro-batch. Step monitors count
each micro-batch on the host (`StepMonitor.count`); their counts ride the step's one all-reduce.

`OptimizerStep` is the step half of the phase trainer (pretrain/trainer.py `PhaseTrainer`, the loop half,
derives from it and sets the attributes declared below); the loop calls `train_step` once per step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from pretrain.checkpointing.cadence import CheckpointCadence
from pretrain.data.batches import RankBatches
from pretrain.data.loader import model_inputs
from pretrain.distributed.info import DistInfo
from pretrain.distributed.stop_request import StopRequest
from pretrain.keys import PHASE_NAMES
from pretrain.metrics.monitor_contract import StepContext, StepMonitor
from pretrain.model.bert import PretrainingOutput
from pretrain.phase_state import LoopPlan, NonFiniteLossError, PhaseState, step_seed
from pretrain.plugin import ExtraLoss, StepAgreement, TrainingPlugin
from pretrain.schedules.batch import BatchRamp
from pretrain.step_feed import StepFeed
from pretrain.step_stats import StepResult, StepSums, StepTotals, host_values_to_device, labelled_slots

__all__ = ["OptimizerStep"]


class OptimizerStep:
    """`train_step` and the loss it back-propagates; the attributes are the trainer's (pretrain/trainer.py)."""

    engine: Any
    settings: LoopPlan
    state: PhaseState
    dist_info: DistInfo
    stop: StopRequest
    plugin: TrainingPlugin
    cadence: CheckpointCadence
    feed: StepFeed
    train_batches: RankBatches
    monitors: list[StepMonitor]
    loss_term: ExtraLoss | None
    replica_group: Any
    accumulation: int  # micro-batches per rank in this optimizer step
    global_batch: int  # samples of this optimizer step over all ranks
    micro_batches_per_step: int  # micro-batches of this optimizer step over all ranks
    ramp: BatchRamp | None  # the phase's batch warmup (pretrain/schedules/batch.py); None: one shape for every step
    round_samples: int  # samples of one micro-batch on every rank: a warmup step's batch is whole rounds of it

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
        """Accumulate this step's micro-batches (the phase's accumulation, or the batch warmup's for this step,
        `shape_step`), then one optimizer step.

        Statistics stay on the device until one all-reduce at the end (a single host sync per step,
        pretrain/step_stats.py), which also carries this rank's stop request so the ranks agree on stopping
        for free, and the step's work counts, so throughput counts every rank's batches. While each
        micro-batch's work is queued, one micro-batch of the next step is read.
        """
        phase_index = PHASE_NAMES.index(self.state.phase)
        scheduled = self._scheduled_values()  # what the phase's schedules give this step (its batches were masked so)
        self.shape_step(self.state.step)
        batches = self.feed.step_batches(self.state.data_position, self.accumulation)
        self.state.data_position += self.global_batch
        mlm_scale = self._step_mlm_scale(batches)  # before the first backward (module docstring)
        next_count = self.accumulation_at(self.state.step + 1) if self.state.step + 1 < self.settings.steps else 0
        sums = StepSums(self.dist_info.device, tuple(name for m in self.monitors for name in m.counts))
        context = self._step_context()
        lr = 0.0
        for micro, host_batch in enumerate(batches):
            batch = model_inputs(host_batch, self.dist_info.device)
            torch.manual_seed(step_seed(self.settings.run.seed, phase_index, self.state.step, micro, self.dist_info.rank))
            if self.ramp is not None:  # DeepSpeed's counter cannot tell the boundary once the accumulation changes
                self.engine.set_gradient_accumulation_boundary(micro == self.accumulation - 1)
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
            for monitor in self.monitors:
                sums.count(monitor.count(host_batch, context))
            self.feed.read_ahead(next_count)
        totals = sums.reduce(bool(self.stop.signal_name), self.cadence.time_due(time.monotonic()),
                             self.replica_group, self.dist_info.world_size)
        return self._result(totals, lr, scheduled)

    def accumulation_at(self, step: int) -> int:
        """Micro-batches per rank of `step` (the batch warmup's, else the engine's)."""
        if self.ramp is None or self.settings.schedules is None:
            return self.accumulation
        return self.settings.schedules.clock.rounds_at(step, self.round_samples)

    def shape_step(self, step: int) -> None:
        """`step`'s accumulation and global batch under a batch warmup, told to DeepSpeed (which divides each
        micro-batch's loss by its accumulation and counts the samples); nothing without one."""
        if self.ramp is None or self.settings.schedules is None:
            return
        self.accumulation = self.settings.schedules.clock.rounds_at(step, self.round_samples)
        self.global_batch = self.settings.schedules.clock.batch_at(step)
        self.micro_batches_per_step = self.global_batch // self.engine.train_micro_batch_size_per_gpu()
        self.engine.set_train_batch_size(self.global_batch)

    def _step_context(self) -> StepContext:
        """What the step monitors may know of this step (pretrain/metrics/monitor_contract.py)."""
        schedules = self.settings.schedules
        progress = None if schedules is None else schedules.clock.at_step(self.state.step)
        return StepContext(progress, self.train_batches.data.vocab)

    def _scheduled_values(self) -> dict[str, float]:
        """Each schedule's value at the start of this step (schedule/<name>): a function of the phase's progress."""
        schedules = self.settings.schedules
        return {} if schedules is None else schedules.values(schedules.clock.at_step(self.state.step))

    def _result(self, totals: StepTotals, lr: float, scheduled: dict[str, float]) -> StepResult:
        """The step's numbers from its one all-reduce, after the ranks (and a plug-in's models) agree on stopping,
        saving and a NaN abort."""
        nonfinite = totals["nonfinite"]
        aborting_here = bool(nonfinite) and (
            self.state.consecutive_nonfinite + 1 >= self.settings.failures.max_consecutive_nonfinite)
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
        values.update(scheduled)
        values["perf/data_wait_s"] = self.feed.wait_s
        return StepResult(applied=applied, nonfinite=nonfinite > 0, values=values, counts=totals.counts(),
                          stop_requested=agreed.stop, save_due=agreed.save_due, abort_elsewhere=abort_elsewhere,
                          counted=totals.counted)
