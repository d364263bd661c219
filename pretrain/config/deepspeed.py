"""The DeepSpeed dict a phase's engine gets, and the line between the two files that make it.

One home per setting. The run config (pretrain/config/sections.py) owns what a recipe tunes: steps,
schedule, peak lr, batch sizes, precision. The DeepSpeed JSON owns engine mechanics: ZeRO stage and
buckets, clipping, offload, the optimizer's type and its other parameters, fp16 loss scaling,
`data_types`. A JSON (or `phaseN.ds_overrides`) that sets a key the run config owns is refused in one
line naming both places, instead of one of two values silently winning (before, `phaseN.lr` beat
`optimizer.params.lr` and the JSON's `bf16.enabled` beat `run.precision: auto`).

pretrain/config/load.py reads and checks the run config; `phase_ds_config` turns one phase of it into the
dict `deepspeed.initialize` takes (pretrain/engine.py); `plan_run` (pretrain/train.py) calls it for
every phase before any engine is built, so a refusal stops the run before phase 1 trains. The
fine-tunes (SQuAD, GLUE) use the same refusal, batch arithmetic and precision rule with their flags as
the owners (pretrain/finetune/common.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pretrain.config.sections import RunConfig
from pretrain.errors import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
PHASE_BATCH_KEYS = ("batch_size", "micro_batch_size", "gradient_accumulation_steps")

# DeepSpeed key (dotted) -> the setting of the run config (or the SQuAD command line) that owns it.
OWNED_KEYS: dict[str, str] = {
    "train_batch_size": "batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "optimizer.params.lr": "lr",
    "bf16.enabled": "precision",
    "fp16.enabled": "precision",
    "scheduler": "schedule",
}


def phase_owners(name: str) -> dict[str, str]:
    """Where a phase's owned settings live in RUN.json (the names the refusal tells the user to set)."""
    return {
        **{key: f"{name}.{key}" for key in PHASE_BATCH_KEYS},
        "lr": f"{name}.lr",
        "precision": "run.precision",
        "schedule": f"{name}.lr_schedule and its keys",  # pretrain/schedule.py: each schedule's, in --help
    }


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _lookup(ds: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = ds
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _suggestion(owner: str, key: str, value: Any) -> str:
    """`owner=value` when the JSON's value says what to set (bf16.enabled: true -> run.precision=bf16)."""
    if key.endswith(".enabled"):
        return f"{owner}={key.split('.')[0]}" if value is True else owner
    if value is None or isinstance(value, dict | list):
        return owner
    return f"{owner}={value}"


def refuse_owned_keys(
    ds: Mapping[str, Any],
    where: str,
    owners: Mapping[str, str],
    home: str = "the run config",
    fix: str = "set {} in RUN.json",
) -> None:
    """ConfigError in one line when `ds` sets keys another place owns: what, where it belongs, how to move it.

    e.g. `phase1.ds_config (x.json): train_batch_size belongs to the run config: set phase1.batch_size=65536
    in RUN.json and remove it here`. Every owned key found is named at once, so one edit fixes the file.
    """
    found = [(key, value) for key in OWNED_KEYS for present, value in [_lookup(ds, key)] if present]
    if not found:
        return
    suggestions = list(dict.fromkeys(_suggestion(owners[OWNED_KEYS[key]], key, value) for key, value in found))
    # bf16.enabled: false beside fp16.enabled: true says run.precision=fp16; the bare name adds nothing
    suggestions = [s for s in suggestions if not any(t.startswith(f"{s}=") for t in suggestions)]
    keys = ", ".join(key for key, _ in found)
    verb, pronoun = ("belongs", "it") if len(found) == 1 else ("belong", "them")
    raise ConfigError(f"{where}: {keys} {verb} to {home}: {fix.format(', '.join(suggestions))} and remove "
                      f"{pronoun} here")


def resolve_batch(
    batch: int | None, micro: int | None, accumulation: int | None, dp_size: int, names: tuple[str, str, str]
) -> dict[str, int]:
    """Global batch = micro x accumulation x data-parallel size: check it, derive the missing one.

    `names` are the user's names of the three values (e.g. phase1.batch_size, or --batch-size), so a
    message names what to change. Returns DeepSpeed's three keys.
    """
    values = dict(zip(names, (batch, micro, accumulation), strict=True))
    for key, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ConfigError(f"{key}: must be a positive integer, got {value!r}")
    missing = [key for key, value in values.items() if value is None]
    if len(missing) > 1:
        raise ConfigError(f"{', '.join(missing)}: set at least two of {', '.join(names)} (the third is derived)")
    total_name, micro_name, accum_name = names
    if batch is None:
        assert micro is not None and accumulation is not None
        batch = micro * accumulation * dp_size
    elif micro is None:
        assert accumulation is not None
        if batch % (accumulation * dp_size):
            raise ConfigError(f"{total_name}: {batch} is not divisible by {accum_name} {accumulation} x "
                              f"data-parallel size {dp_size}")
        micro = batch // (accumulation * dp_size)
    elif accumulation is None:
        if batch % (micro * dp_size):
            raise ConfigError(f"{total_name}: {batch} is not divisible by {micro_name} {micro} x "
                              f"data-parallel size {dp_size}")
        accumulation = batch // (micro * dp_size)
    if batch != micro * accumulation * dp_size:
        raise ConfigError(f"{total_name}: {batch} != {micro_name} {micro} x {accum_name} {accumulation} x "
                          f"data-parallel size {dp_size}")
    return dict(zip(BATCH_KEYS, (batch, micro, accumulation), strict=True))


def effective_precision(precision: str, device_type: str, bf16_supported: bool) -> str:
    """run.precision (or --precision) on this device: auto = fp32 on CPU, bf16 where the GPU has it, else fp16."""
    if precision != "auto":
        return precision
    return "fp32" if device_type == "cpu" else "bf16" if bf16_supported else "fp16"


def precision_of(ds: Mapping[str, Any]) -> str:
    """The precision a DeepSpeed dict runs at: bf16, fp16 or fp32 (a block that is absent is off). The one place
    it is read off a dict: the driver, the launch-time check, the footprint estimate and the model card use it."""
    return next((key for key in ("bf16", "fp16") if (ds.get(key) or {}).get("enabled")), "fp32")


def resolve_precision(ds: dict[str, Any], precision: str, device_type: str, bf16_supported: bool) -> dict[str, Any]:
    """`ds` with bf16/fp16 switched for `precision` on this device (effective_precision).

    The JSON's bf16/fp16 blocks keep their other keys (fp16 loss-scale knobs are engine mechanics);
    fp16 gets dynamic loss scaling unless the JSON sets a scale.
    """
    ds = dict(ds)
    precision = effective_precision(precision, device_type, bf16_supported)
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": precision == "bf16"}
    fp16 = {**ds.get("fp16", {}), "enabled": precision == "fp16"}
    if precision == "fp16":
        fp16.setdefault("loss_scale", 0)  # 0 = dynamic loss scaling
        fp16.setdefault("initial_scale_power", 16)
    ds["fp16"] = fp16
    return ds


def read_ds_json(path: str | Path, where: str) -> dict[str, Any]:
    try:
        ds = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{where}: unreadable: {err}") from err
    if not isinstance(ds, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(ds).__name__}")
    return ds


def check_lr(lr: float | None, key: str) -> float:
    if lr is None:
        raise ConfigError(f"{key}: required (the peak learning rate, > 0)")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise ConfigError(f"{key}: must be > 0, got {lr!r}")
    return float(lr)


def phase_ds_json(config: RunConfig, name: str) -> dict[str, Any]:
    """A phase's DeepSpeed JSON + ds_overrides, refused if either sets an owned key; needs no world size.

    The part of `phase_ds_config` a check can run when the data-parallel size is not known yet (the
    launch-time check of a run whose plug-in splits the world, pretrain/launch/preflight.py).
    """
    phase = config.phase(name)
    where = f"{name}.ds_config ({phase.ds_config})"
    ds = read_ds_json(phase.ds_config, where)
    owners = phase_owners(name)
    refuse_owned_keys(ds, where, owners)
    refuse_owned_keys(phase.ds_overrides, f"{name}.ds_overrides", owners)
    ds = deep_merge(ds, phase.ds_overrides)
    if not isinstance(ds.get("optimizer"), dict) or "type" not in ds["optimizer"]:
        raise ConfigError(f"{where}.optimizer.type: required (e.g. ExactLamb)")
    return ds


def phase_ds_config(
    config: RunConfig, name: str, dp_size: int, device_type: str, bf16_supported: bool = False
) -> dict[str, Any]:
    """The DeepSpeed dict a phase's engine gets: its JSON (refused if it sets an owned key) + ds_overrides,
    then the phase's lr, its batch for `dp_size` data-parallel ranks and run.precision for the device."""
    phase = config.phase(name)
    ds = phase_ds_json(config, name)
    ds["optimizer"] = deep_merge(ds["optimizer"], {"params": {"lr": check_lr(phase.lr, f"{name}.lr")}})
    names = (f"{name}.batch_size", f"{name}.micro_batch_size", f"{name}.gradient_accumulation_steps")
    ds.update(resolve_batch(phase.batch_size, phase.micro_batch_size, phase.gradient_accumulation_steps, dp_size,
                            names))
    return resolve_precision(ds, config.run.precision, device_type, bf16_supported)
