"""Typed run configuration: JSON file, then `--section.key=value` overrides, then validation.

The keys themselves (sections, types, defaults, documentation) are declared in
pretrain/config_sections.py; this module reads, checks and resolves them.

Override order (later wins): dataclass defaults < RUN.json < command-line overrides. Every key of
every section is checked: a typo fails with the dotted key it could not place, before any process
group or engine exists. Free-form dicts (`model.overrides`, `phaseN.ds_overrides`) are checked
where they are used (BertConfig fields, DeepSpeed batch keys).

Relative paths: `ds_config` resolves against the folder of the RUN.json that names it (configs refer
to each other); every other path resolves against the current directory, like any CLI argument.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from pretrain.codistill_config import CodistillConfigError, check_codistill
from pretrain.config_sections import PHASE_NAMES, ConfigError, RunConfig
from pretrain.schedule import ScheduleError, check_schedule

# The schedule's names for a phase's keys: its own check (pretrain/schedule.py) reports in its names.
SCHEDULE_KEYS = {"total_steps": "steps", "warmup_fraction": "warmup_fraction", "power": "decay_power"}


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Coerce/validate one value against its annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(key, value, option)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object, got {value!r}")
        return dict(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is Any:
        return value
    if annotation in (int, float, str, bool) and (type(value) is not annotation):
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
    return value


def _build_section(cls: type, name: str, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {sorted(known)})")
    kwargs = {key: _check_type(f"{name}.{key}", value, hints[key]) for key, value in data.items()}
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> RunConfig:
    hints = typing.get_type_hints(RunConfig)
    sections: dict[str, Any] = {}
    for key, value in data.items():
        if key in hints:
            default = getattr(RunConfig(), key)
            merged = {**dataclasses.asdict(default), **value} if isinstance(value, dict) else value
            sections[key] = _build_section(hints[key], key, merged)
        else:
            raise ConfigError(f"{key}: unknown section (known: {sorted(hints)})")
    return RunConfig(**sections)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`--a.b.c=value` -> (["a","b","c"], value). The value is JSON when it parses, else a string."""
    if not text.startswith("--") or "=" not in text:
        raise ConfigError(f"override {text!r}: expected --section.key=value")
    path, raw = text[2:].split("=", 1)
    keys = path.split(".")
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"override {text!r}: expected --section.key=value")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return keys, value


def apply_override(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(keys)}: {key} is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read RUN.json (or start from defaults when None), apply overrides, type-check every key."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as err:
            raise ConfigError(f"--config: {path} does not exist") from err
        except json.JSONDecodeError as err:
            raise ConfigError(f"--config: {path} is not valid JSON: {err}") from err
        base = path.resolve().parent
    for text in overrides or []:
        apply_override(data, *parse_override(text))
    config = from_dict(data)
    for name in PHASE_NAMES:
        phase = config.phase(name)
        if phase.ds_config and not Path(phase.ds_config).is_absolute():
            candidate = base / phase.ds_config
            if candidate.exists():
                phase.ds_config = str(candidate)
    check_values(config)
    return config


def check_values(config: RunConfig) -> None:
    """Checks that need no files or processes: ranges and choices."""
    if config.run.precision not in ("auto", "fp32", "bf16", "fp16"):
        raise ConfigError(f"run.precision: {config.run.precision!r} is not one of auto, fp32, bf16, fp16")
    if not config.run.phases:
        raise ConfigError("run.phases: empty; name phase1 and/or phase2")
    for name in config.run.phases:
        config.phase(name)
    if list(config.run.phases) != sorted(config.run.phases):
        raise ConfigError(f"run.phases: {config.run.phases} must be in order phase1, phase2")
    for name in config.run.phases:
        phase = config.phase(name)
        try:
            check_schedule(phase.steps, phase.warmup_fraction, phase.decay_power)
        except ScheduleError as err:
            raise ConfigError(f"{name}.{SCHEDULE_KEYS[err.field]}: {err.reason}") from err
        if phase.seq_len <= 0:
            raise ConfigError(f"{name}.seq_len: must be > 0, got {phase.seq_len}")
        if not phase.ds_config:
            raise ConfigError(f"{name}.ds_config: required (a DeepSpeed JSON file)")
        if not Path(phase.ds_config).is_file():
            raise ConfigError(f"{name}.ds_config: {phase.ds_config} does not exist")
        if not (phase.shards or config.data.shards):
            raise ConfigError(f"data.shards: required (or {name}.shards)")
    if config.checkpoint.every_steps <= 0:
        raise ConfigError(f"checkpoint.every_steps: must be > 0, got {config.checkpoint.every_steps}")
    if config.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last: must be >= 1, got {config.checkpoint.keep_last}")
    if config.run.stop_after_steps is not None and config.run.stop_after_steps <= 0:
        raise ConfigError(f"run.stop_after_steps: must be > 0, got {config.run.stop_after_steps}")
    if config.run.dist_timeout_minutes < 1:
        raise ConfigError(f"run.dist_timeout_minutes: must be >= 1, got {config.run.dist_timeout_minutes}")
    if config.logging.val_instances is not None and config.logging.val_instances < 1:
        raise ConfigError(f"logging.val_instances: must be >= 1, got {config.logging.val_instances}")
    if config.failures.max_consecutive_nonfinite < 1:
        raise ConfigError("failures.max_consecutive_nonfinite: must be >= 1")
    if config.data.num_workers < 0:
        raise ConfigError(f"data.num_workers: must be >= 0, got {config.data.num_workers}")
    if config.data.num_parts < 1:
        raise ConfigError(f"data.num_parts: must be >= 1, got {config.data.num_parts}")
    if not 0 <= config.data.part < config.data.num_parts:
        raise ConfigError(f"data.part: must be in [0, data.num_parts={config.data.num_parts}), got {config.data.part}")
    try:
        check_codistill(config.codistill)
    except CodistillConfigError as err:
        raise ConfigError(str(err)) from err
    if config.codistill.enabled and config.codistill.disjoint_data and config.data.num_parts != 1:
        raise ConfigError(
            f"data.num_parts: codistillation deals the data into one part per group (codistill.disjoint_data); "
            f"leave data.part/num_parts unset, got num_parts={config.data.num_parts}"
        )


# --- DeepSpeed JSON of a phase -------------------------------------------------------------------

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
