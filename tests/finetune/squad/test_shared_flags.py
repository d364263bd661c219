"""SQuAD and GLUE share their engine flags (pretrain/finetune/common.py EngineFlags): declared once, and
both command lines accept them identically, each failing with its own one-line error."""

from __future__ import annotations

import dataclasses

import pytest

from pretrain.finetune.common import EngineFlags
from pretrain.finetune.glue.command import GLUE
from pretrain.finetune.glue.finetune_args import GlueConfig
from pretrain.finetune.squad.command import SQUAD
from pretrain.finetune.squad.finetune_args import FinetuneConfig

SHARED = [spec.name for spec in dataclasses.fields(EngineFlags)]
REQUIRED = {"squad": ["--model", "m", "--out", "o", "--dev", "d.json"],
            "glue": ["--task", "rte", "--model", "m", "--data", "d", "--out", "o"]}
ENGINE_ARGV = ["--ds-config", "mine.json", "--max-steps", "7", "--batch-size", "12", "--micro-batch-size", "3",
               "--gradient-accumulation-steps", "2", "--warmup-fraction", "0.25", "--precision", "bf16"]


def test_the_engine_flags_are_declared_once() -> None:
    assert {"ds_config", "max_steps", "batch_size", "micro_batch_size", "gradient_accumulation_steps",
            "warmup_fraction", "precision"} == set(SHARED)
    for config_class in (FinetuneConfig, GlueConfig):
        assert issubclass(config_class, EngineFlags)
        assert not set(SHARED) & set(vars(config_class)["__annotations__"]), config_class  # none redeclared


def _finetune_parser(command):
    parser = command.parser()
    return next(action for action in parser._subparsers._group_actions).choices["finetune"]


def test_both_commands_accept_the_engine_flags_identically() -> None:
    parsed = {}
    for name, command in (("squad", SQUAD), ("glue", GLUE)):
        parser = _finetune_parser(command)
        defaults = parser.parse_args(REQUIRED[name])
        parsed[name] = {flag: getattr(parser.parse_args(REQUIRED[name] + ENGINE_ARGV), flag) for flag in SHARED}
        assert {flag: getattr(defaults, flag) for flag in SHARED} == {
            spec.name: spec.default for spec in dataclasses.fields(EngineFlags)}
        helps = {action.dest: action.help for action in parser._actions if action.dest in SHARED}
        config_class = FinetuneConfig if name == "squad" else GlueConfig
        assert helps == {spec.name: config_class.flag_doc(spec) + " (default: %(default)s)"
                         for spec in dataclasses.fields(EngineFlags)}  # one doc, each command's words
    assert parsed["squad"] == parsed["glue"]
    assert parsed["squad"]["batch_size"] == 12 and parsed["squad"]["precision"] == "bf16"


@pytest.mark.parametrize(("flag", "value", "line"), [
    ("--micro-batch-size", "0", "--micro-batch-size must be > 0, got 0"),
    ("--warmup-fraction", "1.5", "--warmup-fraction must be in [0, 1), got 1.5"),
    ("--max-steps", "-2", "--max-steps must be > 0, got -2"),
])
def test_a_bad_engine_flag_is_one_line_and_exit_2_in_both(flag: str, value: str, line: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    for name, command in (("squad", SQUAD), ("glue", GLUE)):
        assert command.main(["finetune", *REQUIRED[name], flag, value]) == 2, name
        assert capsys.readouterr().err.strip().endswith(line), name
