"""The lr schedules' table (pretrain/schedules/lr.py): every name builds and checks its keys, WSD has the shape counted
by hand, and the plan, the config check, the docs and the report all follow the table.

A new schedule adds its row to BAD_VALUES below (a value each of its keys refuses); the table tests then cover it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.config.load import check_values, from_dict, load_config
from pretrain.config.sections import PhaseSection
from pretrain.distributed.info import DistInfo
from pretrain.errors import ConfigError
from pretrain.plan.run_plan import plan_run
from pretrain.report.records import schedule_text
from pretrain.schedules.lr import (
    SCHEDULES,
    ScheduleSettings,
    WarmupPolyDecay,
    WarmupStableDecay,
    build_schedule,
    schedule_line,
)
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

# Per key a schedule reads: a value its check refuses, and the words the one-line refusal carries.
BAD_VALUES: dict[str, tuple[Any, str]] = {
    "steps": (0, "must be > 0, got 0"),
    "warmup_fraction": (1.0, "must be in [0, 1), got 1.0"),
    "decay_power": (0.0, "must be > 0, got 0.0"),
    "decay_fraction": (0.0, "must be in (0, 1 - warmup_fraction]"),
    "decay_shape": ("cosine", "'cosine' is not one of linear, 1-sqrt"),
    "min_lr_factor": (1.0, "must be in [0, 1), got 1.0"),
}


def keys_of(kind: type) -> list[str]:
    return [f.name for f in dataclasses.fields(kind)]


def settings_keys() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(ScheduleSettings)}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_builds_from_the_phase_keys_with_their_defaults(name: str) -> None:
    kind = SCHEDULES[name]
    fields = keys_of(kind)
    assert fields[0] == "steps", f"{kind.__name__}: the first field is the phase's step count"
    keys = settings_keys()
    assert set(fields[1:]) <= set(keys), f"{kind.__name__} reads keys ScheduleSettings does not declare"
    for f in dataclasses.fields(kind):  # a default of its own, if any, is the key's: one default per key
        if f.default is not dataclasses.MISSING:
            assert f.default == keys[f.name].default, (kind.__name__, f.name)
    schedule = build_schedule(ScheduleSettings(lr_schedule=name, warmup_fraction=0.1), 100)
    assert type(schedule) is kind
    multipliers = [schedule(step) for step in range(100)]
    assert all(0.0 < m <= 1.0 for m in multipliers), "every step of the phase trains at a non-zero lr"
    assert max(multipliers) == 1.0 and multipliers[0] == pytest.approx(0.1)  # the peak; warmup's first step
    assert schedule_line(ScheduleSettings(lr_schedule=name), 100).startswith(f"{name}: ")


def test_every_key_is_read_by_a_schedule_and_has_a_bad_value_here() -> None:
    read = {key for kind in SCHEDULES.values() for key in keys_of(kind)}
    assert set(settings_keys()) - {"lr_schedule"} <= read, "a key no schedule reads"
    assert read <= set(BAD_VALUES), f"add a refused value for {read - set(BAD_VALUES)} to BAD_VALUES"
    assert issubclass(PhaseSection, ScheduleSettings), "a phase's keys are the schedule's"


@pytest.mark.parametrize(("name", "key"), [(name, key) for name, kind in SCHEDULES.items() for key in keys_of(kind)])
def test_a_bad_key_is_one_config_error_line_naming_it(name: str, key: str) -> None:
    value, words = BAD_VALUES[key]
    phase = {"lr_schedule": name, "steps": 10, "warmup_fraction": 0.2, key: value}
    config = from_dict({"run": {"phases": ["phase1"]}, "phase1": phase})
    with pytest.raises(ConfigError) as err:
        check_values(config)  # the config check, before any process starts
    message = str(err.value)
    assert message.startswith(f"phase1.{key}: ") and words in message and "\n" not in message, message
    assert type(err.value) is ConfigError


def test_an_unknown_schedule_names_the_table() -> None:
    config = from_dict({"run": {"phases": ["phase1"]}, "phase1": {"steps": 5, "lr_schedule": "cosine"}})
    with pytest.raises(ConfigError, match=r"^phase1.lr_schedule: 'cosine' is not one of warmup-poly, "
                                          r"warmup-stable-decay$"):
        check_values(config)
    with pytest.raises(ConfigError, match=r"^decay_fraction: must be in \(0, 1 - warmup_fraction\] = \(0, 0.5\]"):
        WarmupStableDecay(10, 0.5, 0.6, "linear", 0.0)  # built directly: the key alone, no phase to name


def test_warmup_stable_decay_against_a_hand_count() -> None:
    # 10 steps: warmup ceil(0.2 x 10) = 2 steps, decay ceil(0.3 x 10) = 3 steps from S = 7, floor 0.1
    linear = WarmupStableDecay(steps=10, warmup_fraction=0.2, decay_fraction=0.3, decay_shape="linear",
                               min_lr_factor=0.1)
    assert (linear.warmup_steps, linear.decay_start) == (2, 7)
    by_hand = [1 / 2, 2 / 2, 1, 1, 1, 1, 1,   # warmup (step + 1) / 2, then the peak held to step 6
               1.0,                           # S = 7: progress 0
               0.1 + 0.9 * (1 - 1 / 3),       # 0.7
               0.1 + 0.9 * (1 - 2 / 3)]       # 0.4: the last step still trains above the floor
    assert [linear(step) for step in range(10)] == pytest.approx(by_hand)
    assert linear(10) == pytest.approx(0.1) and linear(50) == pytest.approx(0.1)  # the floor, after the end
    root = dataclasses.replace(linear, decay_shape="1-sqrt")
    assert root(8) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(1 / 3)))  # 0.4804: below linear's 0.7
    assert root(9) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(2 / 3)))  # 0.2651
    assert root(7) == 1.0 and root(6) == 1.0
    no_stable = WarmupStableDecay(10, 0.2, 0.8, "linear", 0.0)  # the decay starts where the warmup ends
    assert no_stable.decay_start == 2 and no_stable(2) == 1.0 and no_stable(6) == pytest.approx(0.5)
    assert linear.describe() == ("linear warmup over 2 steps, the peak held to step 7, then linear decay over 3 "
                                 "steps to 0.1 x the peak")


def test_the_lr_schedule_key_lists_every_name_for_help_and_docs() -> None:
    text = settings_keys()["lr_schedule"].metadata["doc"]
    assert all(f"{name}: " in text for name in SCHEDULES), text


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tmp_path_factory.mktemp("shards") / "data", train=32, val=8)


def test_the_plan_builds_the_named_schedule_and_records_it_for_the_report(tmp_path: Path, shards: Path) -> None:
    run_json = tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")  # phase1: 6 steps, warmup 0.3
    config = load_config(run_json, ["--phase1.lr_schedule=warmup-stable-decay", "--phase1.decay_fraction=0.5",
                                    "--phase1.decay_shape=linear", "--phase1.min_lr_factor=0.1"])
    plan = plan_run(config, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                    verify_checksums=False)
    assert plan.phases["phase1"].schedule == WarmupStableDecay(6, 0.3, 0.5, "linear", 0.1)
    assert plan.phases["phase2"].schedule == WarmupPolyDecay(4, 0.25, 0.5)  # the default, untouched
    recorded = plan.resolved["resolved"]["schedules"]
    assert recorded["phase1"] == ("warmup-stable-decay: linear warmup over 2 steps, the peak held to step 3, then "
                                  "linear decay over 3 steps to 0.1 x the peak")
    assert schedule_text(plan.resolved, "phase1") == recorded["phase1"]  # what the report and the card print
    older = {**plan.resolved, "resolved": {}, "phase2": {"steps": 4, "warmup_fraction": 0.25, "decay_power": 0.5}}
    assert schedule_text(older, "phase2") == recorded["phase2"] == (  # a run folder from before the record
        "warmup-poly: linear warmup over 1 step, then (1 - progress)^0.5 to 0 at step 4")
