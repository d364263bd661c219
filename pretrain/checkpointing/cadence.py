"""When a step checkpoint is due: every `checkpoint.every_steps` optimizer steps or every
`checkpoint.every_minutes` of wall-clock time, whichever comes first (a phase end and a stop always
write one besides).

Why a clock: a fixed step count costs a different share of the run at every GPU count. BERT-Large
phase 1 does 200 optimizer steps in about a minute on 256 GPUs and in about 20 minutes on 8, while a
save costs several seconds of serial work on any count. Minutes bound both the work a crash loses
and the share of time spent saving, whatever the job's size.

Agreement: a save is collective, so every rank must save after the same step. Step counts agree by
themselves; clocks do not (each rank started its clock at a slightly different moment). So each rank
asks `time_due(now)` just before the step's statistics all-reduce and sends it there as 0/1; the
reduced value is > 0 on every rank as soon as it is 1 on any (a max over ranks), and every rank then
decides with `should_save(step, due_anywhere)`, the same inputs giving the same answer everywhere.

No torch and no clock of its own: `now` is passed in (the trainer passes `time.monotonic()`), so the
rule is tested without DeepSpeed or sleeping, and the run config can check the keys without torch.
"""

from __future__ import annotations

from pretrain.config.checks import check_cadence
from pretrain.config.sections import CheckpointSection


class CheckpointCadence:
    """The save rule of one phase on one rank. `started`: when this process began (or resumed) the phase,
    on the clock the trainer passes as `now` (the first minutes interval counts from there)."""

    def __init__(self, section: CheckpointSection, started: float) -> None:
        check_cadence(section.every_steps, section.every_minutes)
        self.every_steps = section.every_steps
        self.every_seconds = None if section.every_minutes is None else 60.0 * section.every_minutes
        self.last_saved = started

    def step_due(self, step: int) -> bool:
        """`step` (the phase's optimizer steps done) is a multiple of every_steps: the same on every rank."""
        return self.every_steps is not None and step % self.every_steps == 0

    def time_due(self, now: float) -> bool:
        """This rank's clock: every_minutes have passed since the last checkpoint (or the start). Local to
        the rank: agree on it over the ranks before acting on it (module docstring)."""
        return self.every_seconds is not None and now - self.last_saved >= self.every_seconds

    def should_save(self, step: int, time_due_anywhere: bool) -> bool:
        """Save after this step: its number is due, or some rank's clock said so (the agreed flag)."""
        return self.step_due(step) or time_due_anywhere

    def saved(self, now: float) -> None:
        """A checkpoint was just written (any kind): the minutes interval starts again from `now`. The
        step interval does not move: tags stay on multiples of every_steps."""
        self.last_saved = now
