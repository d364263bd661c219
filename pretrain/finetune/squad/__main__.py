"""``python -m pretrain.finetune.squad {evaluate,finetune} ...``: the SQuAD command line (evaluate and --help import
no torch; finetune imports it when it runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.finetune.common import FinetuneCommand, Subcommand, finetune_subcommand
from pretrain.finetune.squad import evaluate
from pretrain.finetune.squad.finetune_args import FinetuneConfig


def load_finetune() -> Callable[[FinetuneConfig], Any]:
    # deferred: finetune imports torch, transformers and DeepSpeed; evaluate and --help stay light
    from pretrain.finetune.squad.finetune import finetune

    return finetune


COMMAND = FinetuneCommand(
    prog="python -m pretrain.finetune.squad",
    description=__doc__,
    evaluate=Subcommand("score predictions exactly as the official SQuAD scripts do",
                        evaluate.add_arguments, evaluate.run),
    finetune=finetune_subcommand("fine-tune a BERT folder on SQuAD with DeepSpeed, then score it",
                                 FinetuneConfig, load_finetune),
)
main = COMMAND.main

if __name__ == "__main__":
    COMMAND.exit()
