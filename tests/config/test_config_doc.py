"""Every config key is documented where it is declared, and `--help` and docs/pretraining.md show it.

The keys are found by walking the dataclasses of `RunConfig` and of every installed plug-in's section
here, not through pretrain/config/doc.py, so a key the generator skipped would fail too.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pretrain.config.doc import DOC_FILE, markdown_table, replace_table
from pretrain.config.load import RunConfig, check_values, from_dict
from pretrain.errors import ConfigError
from pretrain.keys import DOC, setting
from pretrain.plugin_registry import installed_plugins, plugin_spec
from pretrain.schedules.lr import WarmupPolyDecay


def sections() -> list[tuple[str, object]]:
    """(name, default instance) of every core section (from RunConfig()) and every installed plug-in's."""
    root = RunConfig()
    core = [(f.name, getattr(root, f.name)) for f in dataclasses.fields(RunConfig) if f.name != "plugins"]
    return core + [(name, plugin_spec(name).section()) for name in installed_plugins()]


def all_keys() -> list[tuple[str, str, object, str]]:
    """(section, key, default, doc) of every field of every section."""
    keys = []
    for name, value in sections():
        assert dataclasses.is_dataclass(value), f"{name}: a section must be a dataclass"
        keys += [(name, f.name, getattr(value, f.name), f.metadata.get(DOC, "")) for f in dataclasses.fields(value)]
    return keys


def squash(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def help_text() -> str:
    import contextlib
    import io

    from pretrain.train import parse_args

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize(("section", "key", "default", "doc"), all_keys(), ids=lambda v: str(v)[:30])
def test_every_key_is_in_help_with_its_default_and_doc(
    help_text: str, section: str, key: str, default: object, doc: str
) -> None:
    assert doc.strip(), f"{section}.{key}: no documentation; declare it with setting(default, 'what it does')"
    lines = [line for line in help_text.splitlines() if line.strip().startswith(f"--{section}.{key}=")]
    assert len(lines) == 1, f"--{section}.{key} missing from --help"
    assert f"default {json.dumps(default)})" in lines[0]
    assert squash(doc) in squash(help_text)


def test_every_section_has_a_docstring(help_text: str) -> None:
    for name, value in sections():
        doc = type(value).__dict__.get("__doc__") or ""
        assert doc and not doc.startswith(type(value).__name__ + "(")
        assert f"\n{name}: " in help_text


def test_the_codistillation_plugin_is_installed_and_listed() -> None:
    """pyproject.toml's entry point is registered (`pip install -e .`), so the key checks above cover its keys."""
    assert "codistill" in installed_plugins()


def test_help_still_takes_config_and_leaves_overrides() -> None:
    from pretrain.train import parse_args

    assert parse_args(["--config", "r.json", "--phase1.steps=3", "--phase1.step=4"]) == (
        "r.json", ["--phase1.steps=3", "--phase1.step=4"])  # no argparse abbreviation of config keys


def configuration_section() -> str:
    text = DOC_FILE.read_text(encoding="utf-8")
    return re.search(r"^## Configuration\n(.*?)^## ", text, re.S | re.M).group(1)


@pytest.mark.parametrize(("section", "key"), [k[:2] for k in all_keys()], ids=lambda v: str(v))
def test_every_key_is_in_the_docs_configuration_section(section: str, key: str) -> None:
    assert f"`{section}.{key}`" in configuration_section(), f"{section}.{key} missing from {DOC_FILE}"


def test_docs_table_is_generated_from_the_current_declarations() -> None:
    text = DOC_FILE.read_text(encoding="utf-8")
    assert replace_table(text, markdown_table(RunConfig)) == text, (
        "docs/pretraining.md's config table is stale: run `python -m pretrain.config.doc --write`")


def test_setting_copies_mutable_defaults() -> None:
    @dataclasses.dataclass
    class Section:
        items: list[str] = setting(["a"], "a list")

    first, second = Section(), Section()
    first.items.append("b")
    assert second.items == ["a"] and dataclasses.fields(Section)[0].metadata[DOC] == "a list"


def test_no_untyped_extra_section() -> None:
    with pytest.raises(ConfigError, match="extra: unknown section") as err:
        from_dict({"extra": {}})
    assert "'codistill'" in str(err.value) and "'run'" in str(err.value)  # known: core + installed plug-ins
    with pytest.raises(ConfigError, match="plugins: unknown section"):
        from_dict({"plugins": {}})  # the field that holds plug-in sections is no RUN.json key


def test_schedule_ranges_are_checked_once_and_named_in_config_terms() -> None:
    with pytest.raises(ConfigError, match=r"^decay_power: must be > 0, got 0.0$"):
        WarmupPolyDecay(10, 0.1, decay_power=0.0)  # built directly (a fine-tune): the schedule's own key
    config = from_dict({"run": {"phases": ["phase1"]}, "phase1": {"steps": 5, "decay_power": 0}})
    with pytest.raises(ConfigError, match=r"^phase1.decay_power: must be > 0, got 0.0$"):
        check_values(config)  # the schedule's own check, reported with the config's key


def test_squad_finetune_help_lists_every_field_with_its_doc() -> None:
    """The SQuAD flags are generated from FinetuneConfig: each field is a flag with its doc and default."""
    import argparse
    import dataclasses

    from pretrain.finetune.squad import finetune_args

    parser = argparse.ArgumentParser(prog="finetune")
    finetune_args.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for spec in dataclasses.fields(finetune_args.FinetuneConfig):
        option = "--" + spec.name.replace("_", "-")
        doc = " ".join(finetune_args.FinetuneConfig.flag_doc(spec).split())  # shared flags: with SQuAD's words
        assert option in text and doc and doc[:40] in text, option
    args = parser.parse_args(["--model", "m", "--out", "o", "--dev", "d.json", "--precision", "bf16", "--save-model"])
    config = finetune_args.config_from_args(args)
    assert config.precision == "bf16" and config.save_model and config.epochs == 2.0 and config.train is None
