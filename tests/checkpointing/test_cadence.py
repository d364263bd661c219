"""The checkpoint cadence (pretrain/checkpointing/cadence.py): steps, minutes, whichever first, and the keys'
checks. Pure: times are passed in, nothing sleeps."""

from __future__ import annotations

import pytest

from pretrain.checkpointing.cadence import CheckpointCadence
from pretrain.config.load import ConfigError
from pretrain.config.sections import CheckpointSection


def test_steps_alone_save_on_multiples_and_never_by_the_clock() -> None:
    cadence = CheckpointCadence(CheckpointSection(), started=0.0)  # the default: every 500 steps, no minutes
    assert [step for step in range(1, 1501) if cadence.should_save(step, False)] == [500, 1000, 1500]
    assert not cadence.time_due(10.0**9)


def test_minutes_alone_count_from_the_start_and_again_from_each_save() -> None:
    cadence = CheckpointCadence(CheckpointSection(every_steps=None, every_minutes=30), started=100.0)
    assert not cadence.time_due(100.0 + 30 * 60 - 1)
    assert cadence.time_due(100.0 + 30 * 60)
    assert not cadence.step_due(500)
    cadence.saved(5000.0)
    assert not cadence.time_due(5000.0 + 29 * 60)
    assert cadence.time_due(5000.0 + 31 * 60)


def test_whichever_comes_first_and_time_saves_keep_the_step_multiples() -> None:
    cadence = CheckpointCadence(CheckpointSection(every_steps=200, every_minutes=0.5), started=0.0)
    assert cadence.should_save(37, time_due_anywhere=True)  # another rank's clock, agreed in the all-reduce
    assert not cadence.should_save(37, time_due_anywhere=False)
    cadence.saved(40.0)  # a save after step 37 does not move the step interval: the next is still 200
    assert cadence.should_save(200, time_due_anywhere=False)
    assert not cadence.step_due(237)


@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [({"every_steps": 0}, "checkpoint.every_steps: must be > 0 or null, got 0"),
     ({"every_minutes": -5}, "checkpoint.every_minutes: must be > 0 or null, got -5.0"),
     ({"every_minutes": True}, "checkpoint.every_minutes: expected float, got True")],
)
def test_bad_cadence_values_name_the_key(checkpoint: dict, message: str) -> None:
    from pretrain.config.load import from_dict

    with pytest.raises(ConfigError, match=f"^{message}$"):
        CheckpointCadence(from_dict({"checkpoint": checkpoint}).checkpoint, started=0.0)


def test_old_and_new_configs_load() -> None:
    from pretrain.config.load import from_dict

    old = from_dict({"checkpoint": {"every_steps": 200, "keep_last": 3}}).checkpoint
    assert (old.every_steps, old.every_minutes) == (200, None)
    new = from_dict({"checkpoint": {"every_steps": None, "every_minutes": 30}}).checkpoint
    assert (new.every_steps, new.every_minutes) == (None, 30.0)
    both_off = CheckpointCadence(CheckpointSection(every_steps=None), started=0.0)  # phase ends and stops only
    assert not both_off.should_save(10**6, False) and not both_off.time_due(10.0**9)
