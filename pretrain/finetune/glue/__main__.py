"""``python -m pretrain.finetune.glue {evaluate,finetune} ...``: the GLUE command line (evaluate and --help import
no torch; finetune imports it when it runs)."""

from __future__ import annotations

import argparse
import sys

from pretrain.finetune.common import FinetuneCommand, Subcommand
from pretrain.finetune.glue import evaluate, finetune_args


def run_finetune(args: argparse.Namespace) -> int:
    # deferred: finetune imports torch, transformers and DeepSpeed; evaluate and --help stay light
    from pretrain.finetune.glue.finetune import run

    return run(args)


COMMAND = FinetuneCommand(
    prog="python -m pretrain.finetune.glue",
    description=__doc__,
    evaluate=Subcommand(
        "score a GLUE predictions file against the task's labelled dev file",
        evaluate.add_arguments, evaluate.run
    ),
    finetune=Subcommand(
        "fine-tune a BERT folder on a GLUE task with DeepSpeed, N seeds",
        finetune_args.add_arguments, run_finetune
    ),
)


def main(argv: list[str] | None = None) -> int:
    return COMMAND.main(argv)


if __name__ == "__main__":
    sys.exit(main())
