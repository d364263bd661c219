"""Batch-size warmup: the global batch of each optimizer step, growing from a share of the phase's batch to all of it.

Small batches while the gradient noise is small, the full batch once it has grown (GPT-3's batch ramp; ModernBERT
and Ettin warm the batch up over the first tokens). The ramp is counted in whole micro-batches per rank per step
(the accumulation), so every step's batch divides over the ranks and the stream stays whole micro-batches; a step's
batch is a function of the step alone (`accumulation_at`), so a resume on the same number of ranks recomputes the
ramp exactly. The phase clock (progress.py) sums it into each step's first sample, which is where the trainer's data
position, the masking rate and the samples a recipe counts all come from.

On another number of ranks the ramp is the one the phase started with: its accumulation is counted in the starting
world's micro-batch rounds (micro-batch x ranks), a world-size-free number of samples once multiplied out, so the
phase's state records it (`record`, PhaseState.batch_ramp) and a resume keeps it. Each step then takes the same
samples as before; the new world splits a step's batch into its own rounds, which is exact where every remaining
ramp batch and the stream position divide into them, and refused in one line where one does not
(pretrain/schedules/clock.py `first_misfit`): a rank cannot take part of a micro-batch, and the ranks of a step
take the same number of micro-batches (each backward is a collective).

The lr is not rescaled by the ramp: the lr schedule runs over optimizer steps as it does without a ramp (LAMB's
per-layer trust ratio makes an update's size follow the weights', not the batch's; with AdamW, a ramp as short as
the lr warmup keeps the early steps small). DeepSpeed fixes its accumulation when the engine is built; the trainer
tells it each step's batch (`set_train_batch_size`, which also sets the divisor of the loss) and marks the boundary
on each micro-batch (`set_gradient_accumulation_boundary`), because DeepSpeed's own counter,
(micro steps + 1) % accumulation, is wrong as soon as the accumulation changes.

A new kind of warmup is this file and its test (tests/pretrain/test_batch_warmup.py); the keys are declared in
`BatchWarmupSettings`, which PhaseSection (pretrain/config/sections.py) inherits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pretrain.errors import ConfigError
from pretrain.keys import setting

__all__ = ["BatchRamp", "BatchWarmupSettings", "build_batch_ramp", "steps_for_tokens"]



@dataclass
class BatchWarmupSettings:
    """A phase's batch-warmup keys (phaseN.<key>); PhaseSection inherits them."""

    batch_warmup_steps: int = setting(
        0, "batch warmup: over this many first steps the global batch grows linearly from batch_warmup_start x "
           "batch_size to batch_size, in whole micro-batches per rank; logged as schedule/batch_size. The lr "
           "schedule is not rescaled. 0: the full batch from the first step")
    batch_warmup_start: float = setting(0.25, "the first step's share of the global batch under a batch warmup, in (0, 1]")
    batch_warmup_tokens: int = setting(
        0, "batch warmup counted in tokens (sequence positions, samples x seq_len) instead of steps: the ramp "
           "covers the fewest first steps whose batches hold at least this many tokens (ModernBERT and Ettin "
           "count theirs so); set it or batch_warmup_steps, not both")


@dataclass(frozen=True)
class BatchRamp:
    """accumulation_at(step) = the phase's accumulation x (start + (1 - start) x step / steps), rounded half up and at
    least 1, during the first `steps` steps; the phase's accumulation afterwards."""

    accumulation: int  # the phase's micro-batches per rank per step: the full batch
    steps: int = 0
    start: float = 0.25

    def accumulation_at(self, step: int) -> int:
        if step >= self.steps:
            return self.accumulation
        share = self.start + (1.0 - self.start) * step / self.steps
        return max(1, min(self.accumulation, int(self.accumulation * share + 0.5)))

    def record(self) -> dict[str, Any]:
        """The ramp as the phase's state keeps it (JSON): a resume on any number of ranks rebuilds this one."""
        return {"accumulation": self.accumulation, "steps": self.steps, "start": self.start}


def _ramp_tokens(ramp: BatchRamp, micro_tokens: int) -> int:
    """Tokens the ramp's steps hold: `micro_tokens` per micro-batch of every rank (micro x world x seq_len)."""
    return sum(ramp.accumulation_at(step) for step in range(ramp.steps)) * micro_tokens


def steps_for_tokens(tokens: int, accumulation: int, start: float, micro_tokens: int) -> int:
    """The fewest ramp steps whose batches hold at least `tokens` (the ramp's shape depends on its length, so the
    length is searched from the estimate at the ramp's mean share, (1 + start) / 2)."""
    full_step = accumulation * micro_tokens
    steps = max(1, int(tokens / (full_step * (1.0 + start) / 2.0)))
    while steps > 1 and _ramp_tokens(BatchRamp(accumulation, steps - 1, start), micro_tokens) >= tokens:
        steps -= 1
    while _ramp_tokens(BatchRamp(accumulation, steps, start), micro_tokens) < tokens:
        steps += 1
    return steps


def build_batch_ramp(settings: BatchWarmupSettings, accumulation: int, where: str = "",
                     micro_tokens: int = 0) -> BatchRamp | None:
    """The ramp `settings` ask for over a phase whose full batch is `accumulation` micro-batches per rank, each of
    `micro_tokens` tokens over all ranks (None: no ramp); one ConfigError naming the key (`where` in front:
    "phase1.") for a value out of range."""
    steps, start, tokens = settings.batch_warmup_steps, settings.batch_warmup_start, settings.batch_warmup_tokens
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"{where}batch_warmup_steps: must be an integer >= 0, got {steps!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ConfigError(f"{where}batch_warmup_tokens: must be an integer >= 0, got {tokens!r}")
    if steps and tokens:
        raise ConfigError(f"{where}batch_warmup_tokens: set it or batch_warmup_steps ({steps}), not both")
    if isinstance(start, bool) or not isinstance(start, int | float) or not 0.0 < start <= 1.0:
        raise ConfigError(f"{where}batch_warmup_start: must be in (0, 1], got {start!r}")
    if tokens:
        if micro_tokens <= 0:
            raise ConfigError(f"{where}batch_warmup_tokens: the phase's batch holds no tokens to count")
        steps = steps_for_tokens(tokens, accumulation, float(start), micro_tokens)
    return BatchRamp(accumulation, steps, float(start)) if steps else None
