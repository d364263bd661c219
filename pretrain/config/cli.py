"""The command line of `python -m pretrain.train`, light: standard library and the config declarations only.

pretrain/train.py answers `--help` from here before it imports torch and DeepSpeed (which take a
minute on a loaded 2-core machine and print DeepSpeed's warnings first), and the launch-time check
(pretrain/launch/preflight.py) reads a command line with the same parser the ranks use, so both see the same
--config and overrides.
"""

from __future__ import annotations

import argparse

from pretrain.config.doc import format_help
from pretrain.config.sections import RunConfig


class _HelpParser(argparse.ArgumentParser):
    def format_help(self) -> str:
        # built only when asked for: it lists every installed plug-in's keys, which imports their declarations
        self.epilog = format_help(RunConfig)
        return super().format_help()


def parse_args(argv: list[str] | None) -> tuple[str | None, list[str]]:
    """--config, and the `--section.key=value` overrides as strings for pretrain.config.load (not argparse options,
    which would take abbreviations and no nested dict keys); `--help` lists every key from the field docs."""
    parser = _HelpParser(prog="python -m pretrain.train", description="Two-phase BERT pretraining on DeepSpeed.",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="RUN.json (the shipped ones: ds_configs/recipes/*.json)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args, rest = parser.parse_known_args(argv)
    return args.config, rest
