"""``python -m pretrain.finetune.squad {evaluate,finetune} ...``: the SQuAD command line (evaluate and --help import
no torch; finetune imports it when it runs)."""

from __future__ import annotations

import argparse
import sys

from pretrain.finetune.common import FinetuneCommand, Subcommand
from pretrain.finetune.squad import evaluate, finetune_args


def run_finetune(args: argparse.Namespace) -> int:
    # deferred: finetune imports torch, transformers and DeepSpeed; evaluate and --help stay light
    from pretrain.finetune.squad.finetune import run

    return run(args)


COMMAND = FinetuneCommand(
    prog="python -m pretrain.finetune.squad",
    description=__doc__,
    evaluate=Subcommand(
        "score predictions exactly as the official SQuAD scripts do",
        evaluate.add_arguments, evaluate.run
    ),
    finetune=Subcommand(
        "fine-tune a BERT folder on SQuAD with DeepSpeed, then score it",
        finetune_args.add_arguments, run_finetune
    ),
)


def main(argv: list[str] | None = None) -> int:
    return COMMAND.main(argv)


if __name__ == "__main__":
    sys.exit(main())
