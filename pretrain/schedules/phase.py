"""What the plan hands a phase of its schedules: the clock (progress.py) and the schedules read off it.

The data stream asks `mask_rate_at_sample` for each micro-batch it collates (inside DataLoader workers: a frozen,
picklable value, no state); the trainer asks `values` once per step and logs them under schedule/<name>
(TensorBoard and metrics.jsonl), so what a step was trained with is on record next to its loss. The lr is not
here: DeepSpeed's LambdaLR steps it (pretrain/schedules/lr.py) and the trainer logs it as `lr`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.schedules.clock import PhaseClock
from pretrain.schedules.masking import MaskSchedule
from pretrain.schedules.progress import Progress

__all__ = ["PhaseSchedules"]


@dataclass(frozen=True)
class PhaseSchedules:
    """A phase's clock and its schedules besides the lr. `masking` None: the shards hold static masks."""

    clock: PhaseClock
    masking: MaskSchedule | None = None

    def values(self, progress: Progress) -> dict[str, float]:
        """Each schedule's value at `progress`, by its logged tag."""
        out: dict[str, float] = {"schedule/batch_size": float(self.clock.batch_at(progress.step))}
        if self.masking is not None:
            out["schedule/mask_rate"] = self.masking.rate(progress)
        return out

    def mask_rate_at_sample(self, sample: int) -> float | None:
        """The masking rate of the step that holds stream sample `sample` (None: the shards' static masks)."""
        return None if self.masking is None else self.masking.rate(self.clock.at_sample(sample))

    def line_tail(self) -> str:
        """What the phase schedules besides the lr, for the end of its recorded schedule line (the report's and the
        model card's recipe tables print that line): nothing for a constant rate and a fixed batch."""
        tail = ""
        if self.masking is not None and self.masking.start != self.masking.end:
            tail += f"; masking rate {self.masking.describe()}"
        if self.clock.ramp is not None:
            tail += f"; batch warmup: {self.clock.describe_ramp()}"
        return tail

    def describe(self) -> dict[str, str]:
        """Each schedule in words, as config.resolved.json records it."""
        out = {} if self.masking is None else {"masking": self.masking.describe()}
        if self.clock.ramp is not None:
            out["batch_warmup"] = self.clock.describe_ramp()
        return out
