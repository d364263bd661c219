"""The DeepSpeed dict a phase's engine gets: its JSON file, the phase's overrides, lr, batch, precision.

pretrain/config.py reads and checks the run config; this module turns one phase of it into the
dict `deepspeed.initialize` takes (pretrain/engine.py). SQuAD fine-tuning uses the same batch
arithmetic and precision rule (pretrain/squad/finetune.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pretrain.config_sections import ConfigError, RunConfig

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def resolve_batch(ds: dict[str, Any], dp_size: int, where: str) -> dict[str, Any]:
    """Global batch = micro x accumulation x data-parallel size: check it, derive the missing one."""
    values = {key: ds.get(key) for key in BATCH_KEYS}
    for key, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ConfigError(f"{where}.{key}: must be a positive integer, got {value!r}")
    total, micro, accum = (values[k] for k in BATCH_KEYS)
    missing = [k for k, v in values.items() if v is None]
    if len(missing) > 1:
        raise ConfigError(f"{where}: set at least two of {list(BATCH_KEYS)}; missing {missing}")
    if total is None:
        total = micro * accum * dp_size
    elif micro is None:
        if total % (accum * dp_size):
            raise ConfigError(
                f"{where}.train_batch_size: {total} is not divisible by gradient_accumulation_steps {accum} "
                f"x data-parallel size {dp_size}"
            )
        micro = total // (accum * dp_size)
    elif accum is None:
        if total % (micro * dp_size):
            raise ConfigError(
                f"{where}.train_batch_size: {total} is not divisible by train_micro_batch_size_per_gpu {micro} "
                f"x data-parallel size {dp_size}"
            )
        accum = total // (micro * dp_size)
    if total != micro * accum * dp_size:
        raise ConfigError(
            f"{where}.train_batch_size: {total} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accum} x data-parallel size {dp_size}"
        )
    return {**ds, "train_batch_size": total, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum}


def resolve_precision(ds: dict[str, Any], precision: str, device_type: str, bf16_supported: bool) -> dict[str, Any]:
    """bf16 or fp16 (dynamic loss scale) on GPU, fp32 on CPU; `auto` keeps the JSON's choice on GPU."""
    ds = {key: value for key, value in ds.items()}
    wants_bf16 = bool(ds.get("bf16", {}).get("enabled"))
    wants_fp16 = bool(ds.get("fp16", {}).get("enabled"))
    if precision == "auto":
        if device_type == "cpu":
            precision = "fp32"
        elif wants_bf16 or wants_fp16:
            precision = "bf16" if wants_bf16 else "fp16"
        else:
            precision = "bf16" if bf16_supported else "fp16"
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": precision == "bf16"}
    fp16 = {**ds.get("fp16", {}), "enabled": precision == "fp16"}
    if precision == "fp16":
        fp16.setdefault("loss_scale", 0)  # 0 = dynamic loss scaling
        fp16.setdefault("initial_scale_power", 16)
    ds["fp16"] = fp16
    return ds


def phase_ds_config(
    config: RunConfig, name: str, dp_size: int, device_type: str, bf16_supported: bool = False
) -> dict[str, Any]:
    """The DeepSpeed dict a phase's engine gets: file + overrides + lr + batch arithmetic + precision."""
    phase = config.phase(name)
    where = f"{name}.ds_config ({phase.ds_config})"
    try:
        ds = json.loads(Path(phase.ds_config).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{where}: unreadable: {err}") from err
    ds = deep_merge(ds, phase.ds_overrides)
    if "optimizer" not in ds or "type" not in ds["optimizer"]:
        raise ConfigError(f"{where}.optimizer.type: required (e.g. ExactLamb)")
    if "scheduler" in ds:
        raise ConfigError(f"{where}.scheduler: remove it; the phase's warmup/decay fields define the schedule")
    if phase.lr is not None:
        ds["optimizer"] = deep_merge(ds["optimizer"], {"params": {"lr": phase.lr}})
    if not isinstance(ds["optimizer"].get("params", {}).get("lr"), int | float):
        raise ConfigError(f"{where}.optimizer.params.lr: required (or set {name}.lr)")
    ds = resolve_batch(ds, dp_size, where)
    return resolve_precision(ds, config.run.precision, device_type, bf16_supported)
