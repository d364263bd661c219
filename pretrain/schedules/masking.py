"""Masking-rate schedules: the share of each instance's tokens masked for MLM, as a function of `Progress`.

Recent encoder recipes mask more early and less late (Ettin, and the dynamic masking-rate ablations: 30 % down to
15 % over training). A schedule moves the rate of dynamic (unmasked) shards from the phase's rate
(data.mask_probability, else the shards' own) to phaseN.mask_rate_end, linearly or in equal stairs; it is read
per optimizer step, so every micro-batch of a step is masked at the same rate on any number of ranks, and a
resumed run masks each step as the uninterrupted one did (the rate depends on the step alone; each instance's
mask on its own generator, pretrain/data/batches.py). Static shards hold masks made at one rate and refuse a
moving one. Validation stays at BERT's 15 % whatever the schedule.

A new schedule is this file and its test (tests/pretrain/test_masking_schedule.py): a frozen dataclass with
`start`, `end` (and its own keys, declared in `MaskingSettings`), `rate(progress)` and `describe()`, and its row in
`MASK_SCHEDULES` under the name phaseN.masking_schedule gives it. The keys reach RUN.json, `--help` and the docs
because PhaseSection (pretrain/config/sections.py) inherits `MaskingSettings`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Protocol

from pretrain.errors import ConfigError
from pretrain.keys import setting
from pretrain.schedules.progress import Progress

__all__ = ["MASK_SCHEDULES", "MaskSchedule", "MaskingSettings", "build_mask_schedule"]


class MaskSchedule(Protocol):
    start: float
    end: float

    def rate(self, progress: Progress) -> float: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class ConstantRate:
    """the phase's rate throughout (BERT's recipe)"""

    start: float
    end: float

    def rate(self, progress: Progress) -> float:
        return self.start

    def describe(self) -> str:
        return f"{self.start:g} throughout"


@dataclass(frozen=True)
class LinearRate:
    """a straight line from the phase's rate at its first step to mask_rate_end at its last"""

    start: float
    end: float

    def rate(self, progress: Progress) -> float:
        return self.start + (self.end - self.start) * progress.to_last_step

    def describe(self) -> str:
        return f"linear from {self.start:g} at the first step to {self.end:g} at the last"


@dataclass(frozen=True)
class StepwiseRate:
    """mask_rate_stairs equal stretches of steps, the rate moving by equal amounts from the phase's rate on the
    first stretch to mask_rate_end on the last"""

    start: float
    end: float
    mask_rate_stairs: int = 4

    def __post_init__(self) -> None:
        if self.mask_rate_stairs < 2:
            raise ConfigError(f"mask_rate_stairs: must be >= 2, got {self.mask_rate_stairs}")

    def rate(self, progress: Progress) -> float:
        stair = min(self.mask_rate_stairs - 1, int(progress.fraction * self.mask_rate_stairs))
        return self.start + (self.end - self.start) * stair / (self.mask_rate_stairs - 1)

    def describe(self) -> str:
        return f"{self.mask_rate_stairs} stairs from {self.start:g} to {self.end:g}"


# phaseN.masking_schedule -> the schedule: the config check, the plan, --help and the docs read this table
MASK_SCHEDULES: dict[str, type] = {"constant": ConstantRate, "linear": LinearRate, "stepwise": StepwiseRate}



def _summary(kind: type) -> str:
    """The first paragraph of a schedule's docstring, on one line: its entry in the masking_schedule key's text."""
    return " ".join((inspect.getdoc(kind) or "").split("\n\n")[0].split()).rstrip(".")


@dataclass
class MaskingSettings:
    """A phase's masking-schedule keys (phaseN.<key>); PhaseSection inherits them."""

    masking_schedule: str = setting(
        "constant",
        "how the dynamic masking rate moves over the phase, one of " + "; ".join(
            f"{name}: {_summary(kind)}" for name, kind in MASK_SCHEDULES.items())
        + ". It starts at data.mask_probability (else the shards' rate), is read per optimizer step and logged as "
          "schedule/mask_rate; dynamic shards only (static ones refuse a moving rate)",
    )
    mask_rate_end: float | None = setting(
        None, "the masking rate at the phase's last step, in (0, 1) (Ettin: 0.30 -> 0.15); required unless constant")
    mask_rate_stairs: int = setting(4, "stepwise: how many equal stretches of steps the rate moves in (>= 2)")


def build_mask_schedule(settings: MaskingSettings, start: float, static: bool, where: str = "") -> MaskSchedule:
    """The schedule `settings` names, from the phase's rate `start`; one ConfigError naming the key (`where` in
    front: "phase1.") for a bad value, or for a moving rate on `static` shards."""
    kind = MASK_SCHEDULES.get(settings.masking_schedule)
    if kind is None:
        raise ConfigError(f"{where}masking_schedule: {settings.masking_schedule!r} is not one of "
                          f"{', '.join(MASK_SCHEDULES)}")
    if kind is ConstantRate:
        return ConstantRate(start, start)
    if static:
        raise ConfigError(f"{where}masking_schedule: {settings.masking_schedule} needs dynamic shards; these hold "
                          "static masks made at one rate (build them with --masking dynamic)")
    end = settings.mask_rate_end
    if end is None or isinstance(end, bool) or not isinstance(end, int | float) or not 0 < end < 1:
        raise ConfigError(f"{where}mask_rate_end: must be in (0, 1) for masking_schedule "
                          f"{settings.masking_schedule}, got {end!r}")
    own = {f.name: getattr(settings, f.name) for f in fields(kind) if f.name not in ("start", "end")}
    try:
        return kind(float(start), float(end), **own)
    except ConfigError as err:
        raise ConfigError(f"{where}{err}") from None
