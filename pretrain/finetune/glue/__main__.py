"""``python -m pretrain.finetune.glue {evaluate,finetune} ...``: the GLUE command line (evaluate and --help import
no torch; finetune imports it when it runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.finetune.common import FinetuneCommand, Subcommand, finetune_subcommand
from pretrain.finetune.glue import evaluate
from pretrain.finetune.glue.finetune_args import GlueConfig


def load_finetune() -> Callable[[GlueConfig], Any]:
    # deferred: finetune imports torch, transformers and DeepSpeed; evaluate and --help stay light
    from pretrain.finetune.glue.finetune import finetune

    return finetune


COMMAND = FinetuneCommand(
    prog="python -m pretrain.finetune.glue",
    description=__doc__,
    evaluate=Subcommand("score a GLUE predictions file against the task's labelled dev file",
                        evaluate.add_arguments, evaluate.run),
    finetune=finetune_subcommand("fine-tune a BERT folder on a GLUE task with DeepSpeed, N seeds",
                                 GlueConfig, load_finetune),
)
main = COMMAND.main

if __name__ == "__main__":
    COMMAND.exit()
