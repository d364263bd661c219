"""How far a phase is: `Progress`, the one argument of every per-step quantity.

Three units, all first-class, as recipes count in each: optimizer steps (the lr schedules), samples (a data
position, the unit resume and elastic restarts count in) and tokens (batch warmups and masking schedules of
the modern encoder recipes are written in tokens). Tokens are sequence positions, samples x seq_len: known
before a batch is read, identical on any number of ranks and after any resume, which a count of real tokens
is not (it would need the data already read, and a reduce). A phase's clock (clock.py) makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Progress"]


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
