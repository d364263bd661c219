"""The range checks of config values whose meaning lives in a module above the config: the schedule
(pretrain/schedule.py), the checkpoint cadence (pretrain/checkpointing/cadence.py) and the quality marks
(pretrain/metrics/quality.py). Each is declared here, once, and both the config check (load.py, before any
process starts) and the module that uses the values call it, so the config floor imports nothing above it.
They take plain values, not sections: this module sits on the first floor, with the errors alone below it.
"""

from __future__ import annotations

from pretrain.errors import ConfigError


class ScheduleError(ValueError):
    """A schedule parameter is out of range; `field` names it as the schedule does (see check_schedule)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"schedule: {field} {reason}")
        self.field, self.reason = field, reason


def check_schedule(total_steps: int, warmup_fraction: float, power: float) -> None:
    """The schedule's ranges, checked here once: by the schedule itself and by the config check.

    The config check (pretrain/config/load.py) calls this before any process group exists and renames
    `ScheduleError.field` to its own keys (phaseN.steps, .warmup_fraction, .decay_power).
    """
    if total_steps <= 0:
        raise ScheduleError("total_steps", f"must be > 0, got {total_steps}")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ScheduleError("warmup_fraction", f"must be in [0, 1), got {warmup_fraction}")
    if power <= 0:
        raise ScheduleError("power", f"must be > 0, got {power}")


def check_cadence(every_steps: int | None, every_minutes: float | None) -> None:
    """The two cadence keys of the checkpoint section: each null or > 0 (both null: checkpoints only at phase
    ends and stops)."""
    if every_steps is not None and every_steps <= 0:
        raise ConfigError(f"checkpoint.every_steps: must be > 0 or null, got {every_steps}")
    if every_minutes is not None and every_minutes <= 0:
        raise ConfigError(f"checkpoint.every_minutes: must be > 0 or null, got {every_minutes}")


def target_key(mark: float) -> str:
    """How a mark is named in tags and in run_clock.json: 0.72 -> "0.72"."""
    return format(mark, "g")


def check_targets(marks: list[float], key: str = "logging.quality_targets") -> None:
    """Each mark an accuracy in (0, 1], no mark twice (ConfigError naming the key and the value)."""
    for index, mark in enumerate(marks):
        if not 0.0 < mark <= 1.0:
            raise ConfigError(f"{key}[{index}]: {mark} is not a masked-LM accuracy in (0, 1]")
    if len({target_key(mark) for mark in marks}) != len(marks):
        raise ConfigError(f"{key}: {marks} names a mark twice")
