"""Learning-rate schedules, and `SCHEDULES`, the one table every other part of the toolkit reads.

A schedule is a pure function of the optimizer step: the engine wraps the multiplier in a `LambdaLR`, whose step
counter DeepSpeed saves and restores with the checkpoint, so the position in the schedule survives a resume. Each
phase has its own schedule (re-warmed in phase 2) because each phase builds its own engine.

A new schedule is this file and its test (tests/pretrain/test_schedule.py):

1. a frozen dataclass: first field `steps`, then fields named after keys of `ScheduleSettings` (add the key
   there, with its default and text, when it needs a new one); `__post_init__` checks each range with `_refuse`
   (one ConfigError naming the key); `__call__(step)` is the multiplier; `describe()` says it for a person;
2. its row in `SCHEDULES`, under the name RUN.json gives `phaseN.lr_schedule`.

The rest follows from the table, so nothing else is edited: PhaseSection inherits `ScheduleSettings`, so the
keys are RUN.json's and `--phaseN.key=` overrides', and `--help` and docs/pretraining.md list them
(`python -m pretrain.config.doc --write`); the config check (pretrain/config/load.py) and the plan
(pretrain/plan/run_plan.py) both call `build_schedule`; the plan records `schedule_line` in config.resolved.json,
which the report's and the model card's recipe tables print (pretrain/report/records.py).

Standard library and the ground floor only (pretrain/errors.py, pretrain/keys.py's `setting`): the config's
sections (pretrain/config/sections.py) inherit the keys from here, and the fine-tunes build a schedule without
loading the config.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NoReturn, Protocol

from pretrain.errors import ConfigError
from pretrain.keys import setting


class Schedule(Protocol):
    """What the engine and the plan take: the lr multiplier at an optimizer step, and one line for a person."""

    def __call__(self, step: int) -> float: ...

    def describe(self) -> str: ...


def _refuse(key: str, reason: str) -> NoReturn:
    """A schedule's range check: the bare key, which `build_schedule` prefixes with the phase (phase1.decay_fraction)."""
    raise ConfigError(f"{key}: {reason}")


def _check_steps_and_warmup(steps: int, warmup_fraction: float) -> None:
    """The two keys every schedule reads."""
    if steps <= 0:
        _refuse("steps", f"must be > 0, got {steps}")
    if not 0.0 <= warmup_fraction < 1.0:
        _refuse("warmup_fraction", f"must be in [0, 1), got {warmup_fraction}")


def _steps(count: int) -> str:
    return f"{count:,} step{'' if count == 1 else 's'}"


def _warmup_text(warmup_steps: int) -> str:
    return f"linear warmup over {_steps(warmup_steps)}" if warmup_steps else "no warmup"


@dataclass(frozen=True)
class WarmupPolyDecay:
    """Linear warmup to the peak lr, then (1 - progress) ** decay_power down to 0 over all the remaining steps
    (NVIDIA's BERT recipe; decay_power 1 is linear).

    multiplier(step) = (step + 1) / W                                  while step < W (W = warmup steps)
                     = (1 - (step - W) / (steps - W)) ** decay_power     afterwards

    `step` is the number of optimizer steps already applied, so step 0 trains at a small non-zero lr
    rather than wasting a step at lr 0. A callable object (not a lambda) so `LambdaLR.state_dict`
    can record its fields.
    """

    steps: int
    warmup_fraction: float
    decay_power: float = 0.5

    def __post_init__(self) -> None:
        _check_steps_and_warmup(self.steps, self.warmup_fraction)
        if self.decay_power <= 0:
            _refuse("decay_power", f"must be > 0, got {self.decay_power}")

    @property
    def warmup_steps(self) -> int:
        return math.ceil(self.warmup_fraction * self.steps)

    def __call__(self, step: int) -> float:
        warmup = self.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        decay_steps = self.steps - warmup
        progress = min(1.0, (step - warmup) / decay_steps) if decay_steps > 0 else 1.0
        return (1.0 - progress) ** self.decay_power

    def describe(self) -> str:
        return f"{_warmup_text(self.warmup_steps)}, then (1 - progress)^{self.decay_power:g} to 0 at step {self.steps:,}"


# warmup-stable-decay's decay shapes: the share of (peak - floor) left at progress p in [0, 1] through the decay
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
}


@dataclass(frozen=True)
class WarmupStableDecay:
    """Linear warmup, the peak lr held, then a linear or 1-sqrt decay over the last decay_fraction of the steps
    to min_lr_factor x the peak (WSD, the trapezoid Ettin and mmBERT train with).

    multiplier(step) = (step + 1) / W                          while step < W (W = warmup steps)
                     = 1                                       while step < S (S = steps - D, D = decay steps)
                     = m + (1 - m) * shape((step - S) / D)     afterwards (m = min_lr_factor)
    shape(p) = 1 - p (linear) or 1 - sqrt(p) (1-sqrt); the floor m is reached at `steps`, after the last update

    Why: the peak is held for as long as the run lasts, so a run can be extended, or a checkpoint of the stable
    stretch branched into a decay (with other data, as Ettin's decay phase does), without restarting the schedule;
    a 1-sqrt decay over the last ~20% matches a cosine schedule's final loss (Hägele et al. 2024, "Scaling Laws and
    Compute-Optimal Training Beyond Fixed Training Durations"). `step` counts as in WarmupPolyDecay.
    """

    steps: int
    warmup_fraction: float
    decay_fraction: float
    decay_shape: str
    min_lr_factor: float

    def __post_init__(self) -> None:
        _check_steps_and_warmup(self.steps, self.warmup_fraction)
        most = 1.0 - self.warmup_fraction
        if not 0.0 < self.decay_fraction <= most + 1e-9:
            _refuse("decay_fraction", f"must be in (0, 1 - warmup_fraction] = (0, {most:g}], got {self.decay_fraction}")
        if self.decay_shape not in DECAY_SHAPES:
            _refuse("decay_shape", f"{self.decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}")
        if not 0.0 <= self.min_lr_factor < 1.0:
            _refuse("min_lr_factor", f"must be in [0, 1), got {self.min_lr_factor}")

    @property
    def warmup_steps(self) -> int:
        return math.ceil(self.warmup_fraction * self.steps)

    @property
    def decay_start(self) -> int:
        """S: the first step of the decay (never inside the warmup, which rounding up could otherwise make it)."""
        return max(self.warmup_steps, self.steps - math.ceil(self.decay_fraction * self.steps))

    def __call__(self, step: int) -> float:
        warmup, start = self.warmup_steps, self.decay_start
        if step < warmup:
            return (step + 1) / warmup
        if step < start:
            return 1.0
        span = self.steps - start
        progress = min(1.0, (step - start) / span) if span > 0 else 1.0
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * DECAY_SHAPES[self.decay_shape](progress)

    def describe(self) -> str:
        start = self.decay_start
        return (f"{_warmup_text(self.warmup_steps)}, the peak held to step {start:,}, then {self.decay_shape} decay "
                f"over {_steps(self.steps - start)} to {self.min_lr_factor:g} x the peak")


# phaseN.lr_schedule -> the schedule. The one list of names: the config check, the plan, --help and the docs read it.
SCHEDULES: dict[str, type] = {
    "warmup-poly": WarmupPolyDecay,
    "warmup-stable-decay": WarmupStableDecay,
}



def _summary(kind: type) -> str:
    """The first paragraph of a schedule's docstring, on one line: its entry in the lr_schedule key's text."""
    return " ".join((inspect.getdoc(kind) or "").split("\n\n")[0].split()).rstrip(".")


@dataclass
class ScheduleSettings:
    """A phase's lr schedule keys (phaseN.<key>). PhaseSection inherits them: a schedule's own keys live beside it."""

    lr_schedule: str = setting(
        "warmup-poly",
        "the lr's shape over the phase, one of " + "; ".join(f"{name}: {_summary(kind)}" for name, kind in SCHEDULES.items()),
    )
    warmup_fraction: float = setting(0.0, "fraction of the steps with a linear warmup to the peak lr, in [0, 1)")
    decay_power: float = setting(
        0.5, "warmup-poly: after warmup the lr follows (1 - progress) ** decay_power down to 0 (> 0; 1 = linear)")
    decay_fraction: float = setting(
        0.2, "warmup-stable-decay: the share of the steps, at the end, over which the lr decays, in "
             "(0, 1 - warmup_fraction]")
    decay_shape: str = setting(
        "1-sqrt", f"warmup-stable-decay: how the lr falls from the peak to the floor, one of {', '.join(DECAY_SHAPES)} "
                  "(at progress p through the decay, 1 - p or 1 - sqrt(p) of the drop is still to come)")
    min_lr_factor: float = setting(
        0.0, "warmup-stable-decay: the lr at the end of the decay, as a multiple of the peak lr, in [0, 1)")

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any]) -> ScheduleSettings:
        """The settings among a phase's keys as config.resolved.json holds them (a key a file predates: its default)."""
        known = {f.name for f in fields(ScheduleSettings)}
        return ScheduleSettings(**{key: value for key, value in keys.items() if key in known})


def build_schedule(settings: ScheduleSettings, steps: int, where: str = "") -> Schedule:
    """The schedule `settings` names, over `steps` optimizer steps; each field of its class is read from the key of
    that name. A bad key is one ConfigError naming it, `where` in front ("phase1.": RUN.json's own key)."""
    kind = SCHEDULES.get(settings.lr_schedule)
    if kind is None:
        raise ConfigError(f"{where}lr_schedule: {settings.lr_schedule!r} is not one of {', '.join(SCHEDULES)}")
    values = {f.name: getattr(settings, f.name) for f in fields(kind) if f.name != "steps"}
    try:
        return kind(steps, **values)
    except ConfigError as err:
        raise ConfigError(f"{where}{err}") from None


def schedule_line(settings: ScheduleSettings, steps: int) -> str:
    """'warmup-poly: linear warmup over 2,001 steps, ...': the name and the schedule, as the report and the model
    card print them."""
    return f"{settings.lr_schedule}: {build_schedule(settings, steps).describe()}"
