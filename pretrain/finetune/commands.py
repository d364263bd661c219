"""The fine-tunes' command lines, declared together: `python -m pretrain.finetune.squad` and `python -m
pretrain.finetune.glue`, each `{evaluate,finetune}` (their __main__.py runs one). Both share their plumbing
(pretrain/finetune/common.py: FinetuneCommand); what differs is a table entry: the help lines, the scorer's
flags and the fine-tune's config. `evaluate` and --help import no torch; `finetune` imports its module (torch,
transformers, DeepSpeed) when it runs, through the loaders below (literal imports, so the layer test sees them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.finetune.common import FinetuneCommand, Subcommand, finetune_subcommand
from pretrain.finetune.glue import evaluate as glue_evaluate
from pretrain.finetune.glue.finetune_args import GlueConfig
from pretrain.finetune.squad import evaluate as squad_evaluate
from pretrain.finetune.squad.finetune_args import FinetuneConfig


def squad_finetune() -> Callable[[FinetuneConfig], Any]:
    from pretrain.finetune.squad.finetune import finetune  # deferred: torch, transformers, DeepSpeed

    return finetune


def glue_finetune() -> Callable[[GlueConfig], Any]:
    from pretrain.finetune.glue.finetune import finetune  # deferred: torch, transformers, DeepSpeed

    return finetune


def command(task: str, what: str, evaluate: Subcommand, finetune: Subcommand) -> FinetuneCommand:
    return FinetuneCommand(prog=f"python -m pretrain.finetune.{task}",
                           description=f"the {what} command line: evaluate and --help import no torch", evaluate=evaluate,
                           finetune=finetune)


SQUAD = command("squad", "SQuAD",
                Subcommand("score predictions exactly as the official SQuAD scripts do", squad_evaluate.add_arguments,
                           squad_evaluate.run),
                finetune_subcommand("fine-tune a BERT folder on SQuAD with DeepSpeed, then score it", FinetuneConfig,
                                    squad_finetune))
GLUE = command("glue", "GLUE",
               Subcommand("score a GLUE predictions file against the task's labelled dev file",
                          glue_evaluate.add_arguments, glue_evaluate.run),
               finetune_subcommand("fine-tune a BERT folder on a GLUE task with DeepSpeed, N seeds", GlueConfig,
                                   glue_finetune))
