"""One home per setting: what a DeepSpeed JSON may not set, the batch the run config derives, the shipped files.

The run config owns lr, the batch sizes, precision and the schedule; the DeepSpeed JSON owns engine
mechanics. A JSON or `phaseN.ds_overrides` that sets an owned key is refused in one line naming the
file, the key and the run-config key to move it to (pretrain/config/deepspeed.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pretrain.config.deepspeed import OWNED_KEYS, phase_ds_config, phase_owners, refuse_owned_keys
from pretrain.config.load import load_config
from pretrain.errors import ConfigError
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import tiny_run_config

DEEPSPEED_JSONS = sorted((REPO_ROOT / "ds_configs" / "deepspeed").glob("*.json"))
BASE_DS = json.loads((REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json").read_text(encoding="utf-8"))

# owned DeepSpeed key -> (a value a JSON might carry, what the refusal tells the user to set)
OWNED_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "train_batch_size": ({"train_batch_size": 64}, "phase2.batch_size=64"),
    "train_micro_batch_size_per_gpu": ({"train_micro_batch_size_per_gpu": 8}, "phase2.micro_batch_size=8"),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 2}, "phase2.gradient_accumulation_steps=2"),
    "optimizer.params.lr": ({"optimizer": {"params": {"lr": 0.006}}}, "phase2.lr=0.006"),
    "bf16.enabled": ({"bf16": {"enabled": True}}, "run.precision=bf16"),
    "fp16.enabled": ({"fp16": {"enabled": True, "loss_scale": 0}}, "run.precision=fp16"),
    "scheduler": ({"scheduler": {"type": "WarmupLR", "params": {}}}, "phase2.lr_schedule and its keys"),
}


@pytest.fixture
def run_json(tmp_path: Path) -> Path:
    shards = tmp_path / "shards"  # phase_ds_config reads no shards; load_config only needs the key set
    return tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")


def test_every_owned_key_has_a_case() -> None:
    assert set(OWNED_CASES) == set(OWNED_KEYS)


@pytest.mark.parametrize("key", list(OWNED_CASES))
def test_an_owned_key_in_the_file_is_refused_naming_file_key_and_owner(key: str, tmp_path: Path,
                                                                         run_json: Path) -> None:
    from pretrain.config.deepspeed import deep_merge

    change, owner = OWNED_CASES[key]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(deep_merge(BASE_DS, change)), encoding="utf-8")
    config = load_config(run_json, [f"--phase2.ds_config={bad}"])
    with pytest.raises(ConfigError) as err:
        phase_ds_config(config, "phase2", 2, "cpu")
    assert str(err.value) == (f"phase2.ds_config ({bad}): {key} belongs to the run config: set {owner} in RUN.json "
                              "and remove it here")
    phase_ds_config(config, "phase1", 2, "cpu")  # the other phase's file is fine


@pytest.mark.parametrize("key", list(OWNED_CASES))
def test_an_owned_key_in_ds_overrides_is_refused(key: str, run_json: Path) -> None:
    change, owner = OWNED_CASES[key]
    config = load_config(run_json, [f"--phase2.ds_overrides={json.dumps(change)}"])
    with pytest.raises(ConfigError) as err:
        phase_ds_config(config, "phase2", 2, "cpu")
    assert str(err.value) == f"phase2.ds_overrides: {key} belongs to the run config: set {owner} in RUN.json and remove it here"


def test_several_owned_keys_are_named_in_one_line() -> None:
    old_layout = {"train_batch_size": 65536, "train_micro_batch_size_per_gpu": 64, "bf16": {"enabled": True},
                  "optimizer": {"type": "ExactLamb", "params": {"lr": 6e-3}}}
    with pytest.raises(ConfigError) as err:
        refuse_owned_keys(old_layout, "phase1.ds_config (old.json)", phase_owners("phase1"))
    assert str(err.value) == (
        "phase1.ds_config (old.json): train_batch_size, train_micro_batch_size_per_gpu, optimizer.params.lr, "
        "bf16.enabled belong to the run config: set phase1.batch_size=65536, phase1.micro_batch_size=64, "
        "phase1.lr=0.006, run.precision=bf16 in RUN.json and remove them here")
    # a disabled precision block says nothing about which precision to set: only where
    with pytest.raises(ConfigError, match=r"fp16.enabled belongs to the run config: set run.precision in RUN.json"):
        refuse_owned_keys({"fp16": {"enabled": False}}, "x", phase_owners("phase1"))
    refuse_owned_keys({"fp16": {"loss_scale": 0, "initial_scale_power": 12}, "bf16": {}}, "x", phase_owners("phase1"))


@pytest.mark.parametrize(
    ("keys", "dp", "expected"),
    [  # (batch_size, micro_batch_size, gradient_accumulation_steps) -> the engine's three values
        ((64, 4, None), 2, (64, 4, 8)),  # the accumulation follows the number of ranks
        ((64, 4, None), 4, (64, 4, 4)),
        ((64, None, 2), 4, (64, 8, 2)),  # the micro batch derived
        ((None, 4, 2), 3, (24, 4, 2)),  # the global batch derived
    ],
)
def test_the_third_batch_value_is_derived(keys: tuple, dp: int, expected: tuple, run_json: Path) -> None:
    batch, micro, accumulation = (json.dumps(v) for v in keys)
    config = load_config(run_json, [f"--phase1.batch_size={batch}", f"--phase1.micro_batch_size={micro}",
                                    f"--phase1.gradient_accumulation_steps={accumulation}"])
    ds = phase_ds_config(config, "phase1", dp, "cpu")
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == expected
    assert ds["optimizer"]["params"]["lr"] == 5e-3 and ds["optimizer"]["type"] == "ExactLamb"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--phase1.batch_size=66", "--phase1.gradient_accumulation_steps=null"],
         "phase1.batch_size: 66 is not divisible by phase1.micro_batch_size 4 x data-parallel size 4"),
        (["--phase1.micro_batch_size=null"],
         "phase1.batch_size, phase1.micro_batch_size: set at least two of phase1.batch_size, "
         "phase1.micro_batch_size, phase1.gradient_accumulation_steps (the third is derived)"),
        (["--phase1.lr=null"], "phase1.lr: required (the peak learning rate, > 0)"),
        (["--phase1.lr=0"], "phase1.lr: must be > 0, got 0.0"),
        (["--phase1.micro_batch_size=-2"], "phase1.micro_batch_size: must be a positive integer, got -2"),
    ],
)
def test_batch_and_lr_errors_name_the_phase_key(overrides: list[str], message: str, run_json: Path) -> None:
    with pytest.raises(ConfigError) as err:
        phase_ds_config(load_config(run_json, overrides), "phase1", 4, "cpu")
    assert str(err.value) == message


def test_precision_is_run_precision_alone(run_json: Path) -> None:
    config = load_config(run_json)
    on = {(dev, ok): phase_ds_config(config, "phase1", 2, dev, ok) for dev, ok in (("cpu", False), ("cuda", True),
                                                                                  ("cuda", False))}
    assert [(ds["bf16"]["enabled"], ds["fp16"]["enabled"]) for ds in on.values()] == [
        (False, False), (True, False), (False, True)]  # auto: fp32 on CPU, bf16 where the GPU has it, else fp16
    assert on[("cuda", False)]["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    fp16 = phase_ds_config(load_config(run_json, ["--run.precision=fp16"]), "phase1", 2, "cpu")
    assert fp16["fp16"]["enabled"] and not fp16["bf16"]["enabled"]


@pytest.mark.parametrize("path", DEEPSPEED_JSONS, ids=[p.name for p in DEEPSPEED_JSONS])
def test_every_shipped_deepspeed_json_passes_the_refusal_check(path: Path) -> None:
    from pretrain.finetune.squad.finetune import SQUAD_OWNERS

    ds = json.loads(path.read_text(encoding="utf-8"))
    owners = SQUAD_OWNERS if path.name.startswith("squad") else phase_owners("phase1")
    refuse_owned_keys(ds, str(path), owners)  # raises when the file sets an owned key
    assert ds["optimizer"]["type"] in ("ExactLamb", "AdamW") and "params" in ds["optimizer"]


def test_every_shipped_deepspeed_json_is_used() -> None:
    named = {Path(phase.ds_config).name
             for run in (REPO_ROOT / "ds_configs" / "recipes").glob("*.json") for _, phase in load_config(run).phases()}
    named.add(Path(json.loads((REPO_ROOT / "pretrain" / "demo" / "demo_run.json").read_text())["phase1"]["ds_config"]).name)
    squad = {p.name for p in DEEPSPEED_JSONS if p.name.startswith("squad")}
    assert named | squad == {p.name for p in DEEPSPEED_JSONS}, "a DeepSpeed JSON no recipe names"


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO_ROOT / "ds_configs" / "recipes").glob("*.json")))
def test_the_rehearsal_shrinks_the_phase_batch_keys_not_the_json(recipe: str, tmp_path: Path) -> None:
    from pretrain.config.rehearsal import shrink_run_config

    recipes = REPO_ROOT / "ds_configs" / "recipes"
    shipped = json.loads((recipes / recipe).read_text(encoding="utf-8"))
    shrunk = shrink_run_config(shipped, recipes, tmp_path / "shards", tmp_path, ranks=2, steps=4)
    (tmp_path / "run.json").write_text(json.dumps(shrunk), encoding="utf-8")
    config = load_config(tmp_path / "run.json")
    groups = 2 if shipped.get("codistill", {}).get("enabled") else 1
    assert shrunk["run"]["precision"] == "bf16"  # what a GPU with bf16 runs
    for name in config.run.phases:
        overrides = shrunk[name]["ds_overrides"]
        refuse_owned_keys(overrides, name, phase_owners(name))  # only bucket sizes there
        ds = phase_ds_config(config, name, 2 // groups, "cpu")
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
            4 * 2 // groups, 2, 2)
        assert ds["optimizer"]["params"]["lr"] == shipped[name]["lr"]  # the recipe's own lr is rehearsed


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--run.host_fault_limit=-1", "run.host_fault_limit: must be >= 0 (0: never), got -1"),
        ("--run.host_fault_hours=0", "run.host_fault_hours: must be > 0, got 0.0"),
        ("--run.slow_rank_threshold=0", "run.slow_rank_threshold: must be > 0, got 0.0"),
        ("--run.slow_rank_window_steps=-1", "run.slow_rank_window_steps: must be >= 0 (0: off), got -1"),
    ],
)
def test_the_bad_host_and_slow_rank_settings_are_checked_at_load(override: str, message: str, run_json: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(run_json, [override])
    assert str(err.value) == message
