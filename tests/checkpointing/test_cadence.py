"""The checkpoint cadence (pretrain/checkpointing/cadence.py): steps, minutes, whichever first, and the keys'
checks. Pure: times are passed in, nothing sleeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.checkpointing.cadence import CadenceSection, CheckpointCadence
from pretrain.config.sections import CheckpointSection
from pretrain.errors import ConfigError


def test_steps_alone_save_on_multiples_and_never_by_the_clock() -> None:
    cadence = CheckpointCadence(CadenceSection(), started=0.0)  # the default: every 500 steps, no minutes
    assert [step for step in range(1, 1501) if cadence.should_save(step, False)] == [500, 1000, 1500]
    assert not cadence.time_due(10.0**9)


def test_minutes_alone_count_from_the_start_and_again_from_each_save() -> None:
    cadence = CheckpointCadence(CadenceSection(every_steps=None, every_minutes=30), started=100.0)
    assert not cadence.time_due(100.0 + 30 * 60 - 1)
    assert cadence.time_due(100.0 + 30 * 60)
    assert not cadence.step_due(500)
    cadence.saved(5000.0)
    assert not cadence.time_due(5000.0 + 29 * 60)
    assert cadence.time_due(5000.0 + 31 * 60)


def test_whichever_comes_first_and_time_saves_keep_the_step_multiples() -> None:
    cadence = CheckpointCadence(CadenceSection(every_steps=200, every_minutes=0.5), started=0.0)
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
        section = from_dict({"checkpoint": checkpoint}).checkpoint  # the section the run plan hands the trainer
        CheckpointCadence(section, started=0.0)


def test_the_rules_defaults_are_the_config_keys_defaults() -> None:
    """A LoopPlan made without a config (tests, benchmarks) saves as a default run config does: the config's
    checkpoint section is the cadence's declaration, so its keys are the cadence's own."""
    section = CheckpointSection()
    assert isinstance(section, CadenceSection)
    assert (section.every_steps, section.every_minutes) == (CadenceSection().every_steps, CadenceSection().every_minutes)


def test_old_and_new_configs_load() -> None:
    from pretrain.config.load import from_dict

    old = from_dict({"checkpoint": {"every_steps": 200, "keep_last": 3}}).checkpoint
    assert (old.every_steps, old.every_minutes) == (200, None)
    new = from_dict({"checkpoint": {"every_steps": None, "every_minutes": 30}}).checkpoint
    assert (new.every_steps, new.every_minutes) == (None, 30.0)
    both_off = CheckpointCadence(CadenceSection(every_steps=None), started=0.0)  # phase ends and stops only
    assert not both_off.should_save(10**6, False) and not both_off.time_due(10.0**9)


def test_the_young_daly_interval_and_the_time_it_leaves() -> None:
    """sqrt(2 x C x MTBF), by hand: a 30 s save and one failure every 8 h on 1,024 GPUs give 1,315 s; the loss is a
    save per interval plus half an interval redone per failure."""
    from pretrain.checkpointing.cadence import interval_advice, mtbf_seconds, young_daly_seconds

    assert mtbf_seconds(1024) == pytest.approx(8 * 3600.0) and mtbf_seconds(8) == pytest.approx(1024 * 3600.0)
    assert young_daly_seconds(30.0, 8 * 3600.0) == pytest.approx((2 * 30 * 28_800) ** 0.5) == pytest.approx(1314.5, abs=0.1)
    advice = interval_advice(30.0, 1024)
    lost = 30 / 1314.534 + 1314.534 / (2 * 28_800)
    assert advice == ("save every 21.9 min (checkpoint.every_minutes; Young/Daly for a 30 s save and a failure every "
                      f"8 h, one per 8,192 GPU-hours on 1024 devices: {lost:.2%} of the time lost)")
    assert "a failure every 2 h:" in interval_advice(30.0, 1024, mtbf_hours=2.0)
    with pytest.raises(ValueError, match="must be > 0"):
        young_daly_seconds(0.0, 100.0)


def test_the_measured_save_cost_is_the_median_of_the_last_saves(tmp_path: Path) -> None:
    import json

    from pretrain.checkpointing.cadence import SAVE_SECONDS_TAG, measured_save_seconds
    from pretrain.run_folder import metrics_path

    assert measured_save_seconds(tmp_path) is None
    path = metrics_path(tmp_path)
    path.parent.mkdir(parents=True)
    rows = [{"step": 1, "loss/mlm": 3.0}, *({"step": s, SAVE_SECONDS_TAG: float(s)} for s in range(2, 10))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 10, "checkp')  # a torn last line
    assert measured_save_seconds(tmp_path) == 7.0  # the median of the last five: 5..9
