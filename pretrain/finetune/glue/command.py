"""`python -m pretrain.finetune.glue {evaluate,finetune}`: the GLUE command line, declared beside the task it runs
(its __main__.py runs it). The plumbing is shared with SQuAD (pretrain/finetune/common.py: FinetuneCommand); what is
GLUE's own is this entry: the help lines, the scorer's flags and the fine-tune's config. It lives in the task's
folder so the entry point imports down only (as pretrain/finetune/squad/command.py says). `evaluate` and --help
import no torch; `finetune` imports its module (torch, transformers, DeepSpeed) only when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.finetune.common import FinetuneCommand, Subcommand, finetune_subcommand
from pretrain.finetune.glue import evaluate
from pretrain.finetune.glue.finetune_args import GlueConfig


def load_finetune() -> Callable[[GlueConfig], Any]:
    from pretrain.finetune.glue.finetune import finetune  # deferred: torch, transformers, DeepSpeed

    return finetune


GLUE = FinetuneCommand(
    prog="python -m pretrain.finetune.glue", description="the GLUE command line: evaluate and --help import no torch",
    evaluate=Subcommand("score a GLUE predictions file against the task's labelled dev file", evaluate.add_arguments,
                        evaluate.run),
    finetune=finetune_subcommand("fine-tune a BERT folder on a GLUE task with DeepSpeed, N seeds", GlueConfig,
                                 load_finetune))
