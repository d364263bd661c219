"""A phase's clock: where each optimizer step lies on the phase's stream of samples, and its `Progress`.

The clock is the one place that maps steps onto the stream: step s of a phase starts at sample s x G (G the
global batch), or, under a batch warmup (batch.py), at the sum of the smaller batches before it; a rank's
micro-batch, which never straddles two steps, knows the step it belongs to from its first sample alone. The data
stream (pretrain/data/batches.py) and the trainer ask the same clock, so the rate a batch was masked at, the
batch a step took and the values the trainer logs for the step agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.schedules.batch import BatchRamp
from pretrain.schedules.progress import Progress

__all__ = ["PhaseClock"]


@dataclass(frozen=True)
class PhaseClock:
    """A phase's steps on its stream of samples: `global_batch` samples per optimizer step (fewer during a batch
    warmup, `ramp`), `seq_len` per sample."""

    phase_steps: int
    global_batch: int
    seq_len: int
    ramp: BatchRamp | None = None

    def __post_init__(self) -> None:
        if self.global_batch <= 0 or self.seq_len <= 0:
            raise ValueError(f"a phase clock needs a positive batch and length, got {self.global_batch}, {self.seq_len}")

    def batch_at(self, step: int) -> int:
        """The global batch of `step`: whole micro-batches of every rank, the ramp's share of the full batch."""
        if self.ramp is None:
            return self.global_batch
        return self.global_batch // self.ramp.accumulation * self.ramp.accumulation_at(step)

    def samples_before(self, step: int) -> int:
        """The stream position (samples of all ranks) at which `step` starts."""
        if self.ramp is None or step <= 0:
            return max(step, 0) * self.global_batch
        ramped = min(step, self.ramp.steps)
        return sum(self.batch_at(s) for s in range(ramped)) + (step - ramped) * self.global_batch

    def step_of_sample(self, sample: int) -> int:
        """The optimizer step whose batch holds stream sample `sample`."""
        if self.ramp is None:
            return sample // self.global_batch
        start = 0
        for step in range(self.ramp.steps):
            start += self.batch_at(step)
            if sample < start:
                return step
        return self.ramp.steps + (sample - start) // self.global_batch

    def with_ramp(self, ramp: BatchRamp | None) -> PhaseClock:
        """This clock under another ramp of the same full batch (the one a resumed phase started with)."""
        return PhaseClock(self.phase_steps, self.global_batch, self.seq_len, ramp)

    def rounds_at(self, step: int, round_samples: int) -> int:
        """Micro-batches per rank of `step` in a world whose micro-batch round (micro-batch x ranks) holds
        `round_samples` samples."""
        return self.batch_at(step) // round_samples

    def first_misfit(self, step: int, position: int, round_samples: int) -> str | None:
        """Why the steps from `step` (its stream position `position`) cannot run in rounds of `round_samples`
        samples, or None: the position and every ramp batch left must be whole rounds (the full batch is, as the
        DeepSpeed dict of every world size checks)."""
        if position % round_samples:
            return f"step {step} starts at sample {position:,}"
        last = step if self.ramp is None else max(step, self.ramp.steps)
        bad = next((s for s in range(step, last) if self.batch_at(s) % round_samples), None)
        return None if bad is None else f"step {bad} takes {self.batch_at(bad):,} samples"

    def describe_ramp(self) -> str:
        """The batch warmup in sequences of all ranks, which read the same on any number of ranks."""
        if self.ramp is None:
            return "none"
        return (f"{self.batch_at(0):,} of {self.global_batch:,} sequences at the first step, the full batch from "
                f"step {self.ramp.steps:,}")

    def at_step(self, step: int) -> Progress:
        samples = self.samples_before(step)
        return Progress(step=step, phase_steps=self.phase_steps, samples=samples, tokens=samples * self.seq_len)

    def at_sample(self, sample: int) -> Progress:
        """The progress of the step that holds stream sample `sample` (a micro-batch asks with its first sample)."""
        return self.at_step(self.step_of_sample(sample))
