"""How far a phase is: `Progress`, the one argument of every per-step quantity, and `PhaseClock`, its source.

Three units, all first-class, as recipes count in each: optimizer steps (the lr schedules), samples (a data
position, the unit resume and elastic restarts count in) and tokens (batch warmups and masking schedules of
the modern encoder recipes are written in tokens). Tokens are sequence positions, samples x seq_len: known
before a batch is read, identical on any number of ranks and after any resume, which a count of real tokens
is not (it would need the data already read, and a reduce).

The clock is the one place that maps steps onto the stream: step s of a phase starts at sample s x G (G the
global batch), so a rank's micro-batch, which never straddles two steps, knows the step it belongs to from its
first sample alone. The data stream (pretrain/data/batches.py) and the trainer ask the same clock, so the rate a
batch was masked at and the rate the trainer logs for its step are one number.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PhaseClock", "Progress"]


@dataclass(frozen=True)
class Progress:
    """Where a phase stands at the start of an optimizer step."""

    step: int  # optimizer steps of the phase already done (0 at its first step)
    phase_steps: int  # optimizer steps of the whole phase
    samples: int  # samples of the phase's stream consumed by all ranks before this step
    tokens: int  # sequence positions of those samples (samples x seq_len)

    @property
    def fraction(self) -> float:
        """Share of the phase done, in [0, 1]: 0 at its first step, (steps - 1) / steps at its last."""
        return min(1.0, self.step / self.phase_steps) if self.phase_steps > 0 else 1.0

    @property
    def to_last_step(self) -> float:
        """Share of the way from the first step (0) to the last step (1): a schedule that must reach its end value
        on the phase's last step, not after it, reads this."""
        return min(1.0, self.step / (self.phase_steps - 1)) if self.phase_steps > 1 else 1.0


@dataclass(frozen=True)
class PhaseClock:
    """A phase's steps on its stream of samples: `global_batch` samples per optimizer step, `seq_len` per sample."""

    phase_steps: int
    global_batch: int
    seq_len: int

    def __post_init__(self) -> None:
        if self.global_batch <= 0 or self.seq_len <= 0:
            raise ValueError(f"a phase clock needs a positive batch and length, got {self.global_batch}, {self.seq_len}")

    def samples_before(self, step: int) -> int:
        """The stream position (samples of all ranks) at which `step` starts."""
        return step * self.global_batch

    def step_of_sample(self, sample: int) -> int:
        """The optimizer step whose batch holds stream sample `sample`."""
        return sample // self.global_batch

    def at_step(self, step: int) -> Progress:
        samples = self.samples_before(step)
        return Progress(step=step, phase_steps=self.phase_steps, samples=samples, tokens=samples * self.seq_len)

    def at_sample(self, sample: int) -> Progress:
        """The progress of the step that holds stream sample `sample` (a micro-batch asks with its first sample)."""
        return self.at_step(self.step_of_sample(sample))
