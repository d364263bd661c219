"""The range checks of config values whose meaning lives in a module above the config: the checkpoint cadence
(pretrain/checkpointing/cadence.py) and the quality marks (pretrain/metrics/quality.py). Each is declared here,
once, and both the config check (load.py, before any process starts) and the module that uses the values call
it, so the config floor imports nothing above it. They take plain values, not sections: this module sits on the
first floor, with the errors alone below it. (The lr schedule needs no entry here: it sits on the ground floor
and checks its own keys, pretrain/schedules/lr.py.)
"""

from __future__ import annotations

from pretrain.errors import ConfigError


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
