"""Typed run configuration: JSON file, then `--section.key=value` overrides, then validation.

The keys themselves (sections, types, defaults, documentation) are declared in
pretrain/config/sections.py; this module reads, checks and resolves them.

Plug-in sections (pretrain/plugin.py): a top-level key that is no core section is looked up in the
plug-in registry the loader is handed (by default the installed entry points, named after their
section); only then is that plug-in imported, and its declaration types and checks the section into
`RunConfig.plugins`.

Override order (later wins): dataclass defaults < RUN.json < command-line overrides. Every key of
every section is checked: a typo fails with the dotted key it could not place, before any process
group or engine exists. Free-form dicts (`model.overrides`, `phaseN.ds_overrides`) are checked
where they are used (BertConfig fields; DeepSpeed keys the run config owns are refused in
pretrain/config/deepspeed.py).

Relative paths: `ds_config` resolves against the folder of the RUN.json that names it (configs refer
to each other); every other path resolves against the current directory, like any CLI argument.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any

from pretrain.config.sections import PLUGINS_FIELD, DataSection, RunConfig
from pretrain.errors import ConfigError
from pretrain.keys import PHASE_NAMES
from pretrain.plugin_registry import INSTALLED, PluginRegistry
from pretrain.schedules.lr import build_schedule


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


def _did_you_mean(key: str, known: typing.Iterable[str], prefix: str = "") -> str:
    """'; did you mean phase1.warmup_fraction?' for a near miss, else the known names: a typo is fixed from the
    one line, without opening --help."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return f"; did you mean {prefix}{close[0]}?" if close else f" (known: {sorted(known)})"


def _build_section(cls: type, name: str, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key{_did_you_mean(key, known, f'{name}.')}")
    kwargs = {key: _check_type(f"{name}.{key}", value, hints[key]) for key, value in data.items()}
    return cls(**kwargs)


def from_dict(data: dict[str, Any], registry: PluginRegistry = INSTALLED) -> RunConfig:
    """Core sections by their type; any other top-level key must name a plug-in's section in `registry`
    (default: the installed entry points)."""
    hints = {name: cls for name, cls in typing.get_type_hints(RunConfig).items() if name != PLUGINS_FIELD}
    sections: dict[str, Any] = {}
    plugins: dict[str, Any] = {}
    for key, value in data.items():
        if key in hints:  # a core section over its default (phase2's differs from phase1's)
            default, target = getattr(RunConfig(), key), sections
        elif key in registry.names():  # read only for a non-core key: a plain config scans nothing
            default, target = registry.spec(key).section(), plugins
        else:
            hint = _did_you_mean(key, [*hints, *registry.names()])
            if not hint.startswith(";"):  # no near miss: perhaps a plug-in that is not installed yet
                hint += ("; a plug-in's section is known once its entry point is installed: rerun "
                         "`pip install -e .` after updating a checkout")
            raise ConfigError(f"{key}: unknown section{hint}")
        merged = {**dataclasses.asdict(default), **value} if isinstance(value, dict) else value
        target[key] = _build_section(type(default), key, merged)
    return RunConfig(**sections, plugins=plugins)


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


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, registry: PluginRegistry = INSTALLED
) -> RunConfig:
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
    config = from_dict(data, registry)
    for name in PHASE_NAMES:
        phase = config.phase(name)
        if phase.ds_config and not Path(phase.ds_config).is_absolute():
            candidate = base / phase.ds_config
            if candidate.exists():
                phase.ds_config = str(candidate)
    check_values(config, registry)
    return config


def check_data_values(data: DataSection) -> None:
    """The data section's choices and ranges: the objective, the masking rate, the parts of the training data."""
    if data.objective not in (None, "mlm", "mlm+nsp"):
        raise ConfigError(f"data.objective: {data.objective!r} is not one of mlm, mlm+nsp (or null: the shards decide)")
    rate = data.mask_probability
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < 1):
        raise ConfigError(f"data.mask_probability: must be in (0, 1) or null, got {rate!r}")
    data.check_parts()


def check_values(config: RunConfig, registry: PluginRegistry = INSTALLED) -> None:
    """Checks that need no files or processes: ranges and choices."""
    if config.run.precision not in ("auto", "fp32", "bf16", "fp16"):
        raise ConfigError(f"run.precision: {config.run.precision!r} is not one of auto, fp32, bf16, fp16")
    if not config.run.phases:
        raise ConfigError("run.phases: empty; name phase1 and/or phase2")
    check_model_path(config)
    for name in config.run.phases:
        config.phase(name)
    if list(config.run.phases) != sorted(config.run.phases):
        raise ConfigError(f"run.phases: {config.run.phases} must be in order phase1, phase2")
    for name in config.run.phases:
        phase = config.phase(name)
        build_schedule(phase, phase.steps, f"{name}.")  # the schedule's own checks, named phaseN.<key>
        if phase.seq_len <= 0:
            raise ConfigError(f"{name}.seq_len: must be > 0, got {phase.seq_len}")
        if not phase.ds_config:
            raise ConfigError(f"{name}.ds_config: required (a DeepSpeed JSON file)")
        if not Path(phase.ds_config).is_file():
            raise ConfigError(f"{name}.ds_config: {phase.ds_config} does not exist")
        if not (phase.shards or config.data.shards):
            raise ConfigError(f"data.shards: required (or {name}.shards)")
    # the checks each component declares beside its keys
    config.checkpoint.check_cadence()  # every_steps / every_minutes: null or > 0
    config.logging.check_targets()  # accuracies in (0, 1], each once
    config.logging.check_validation()
    config.run.check_stop()
    config.run.check_slow_ranks()
    config.failures.check_failures()
    config.data.check_feed()
    if config.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last: must be >= 1, got {config.checkpoint.keep_last}")
    if config.run.dist_timeout_minutes < 1:
        raise ConfigError(f"run.dist_timeout_minutes: must be >= 1, got {config.run.dist_timeout_minutes}")
    if config.run.max_restarts < 0:
        raise ConfigError(f"run.max_restarts: must be >= 0, got {config.run.max_restarts}")
    for key in ("hang_timeout_minutes", "startup_timeout_minutes"):
        if not getattr(config.run, key) > 0:
            raise ConfigError(f"run.{key}: must be > 0, got {getattr(config.run, key)}")
    if config.run.host_fault_limit < 0:
        raise ConfigError(f"run.host_fault_limit: must be >= 0 (0: never), got {config.run.host_fault_limit}")
    if not config.run.host_fault_hours > 0:
        raise ConfigError(f"run.host_fault_hours: must be > 0, got {config.run.host_fault_hours}")
    check_data_values(config.data)
    for name, section in config.plugins.items():  # each plug-in's own checks, cross-section ones included
        try:
            registry.spec(name).check(section, config)
        except ValueError as err:
            raise ConfigError(str(err)) from err


ATTENTION_CHOICES = ("auto", "unpadded", "padded")


def check_model_path(config: RunConfig) -> None:
    """model.attention is a known path; model.compile only where it applies (the unpadded layers)."""
    attention = config.model.attention
    if attention not in ATTENTION_CHOICES:
        raise ConfigError(f"model.attention: {attention!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    if config.model.compile and attention == "padded":
        raise ConfigError("model.compile: compiles the unpadded encoder layers; set model.attention=auto or unpadded, "
                          "or model.compile=false")

