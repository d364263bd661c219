"""`python -m pretrain.finetune.squad {evaluate,finetune}`: the SQuAD command line, declared beside the task it runs
(its __main__.py runs it). The plumbing is shared with GLUE (pretrain/finetune/common.py: FinetuneCommand); what is
SQuAD's own is this entry: the help lines, the scorer's flags and the fine-tune's config. It lives in the task's
folder, not in a table above both tasks, so the entry point imports down only (a table in pretrain/finetune/ that
imported squad/ while squad/__main__.py imported the table was a circle between the two folders). `evaluate` and
--help import no torch; `finetune` imports its module (torch, transformers, DeepSpeed) only when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.finetune.common import FinetuneCommand, Subcommand, finetune_subcommand
from pretrain.finetune.squad import evaluate
from pretrain.finetune.squad.finetune_args import FinetuneConfig


def load_finetune() -> Callable[[FinetuneConfig], Any]:
    from pretrain.finetune.squad.finetune import finetune  # deferred: torch, transformers, DeepSpeed

    return finetune


SQUAD = FinetuneCommand(
    prog="python -m pretrain.finetune.squad", description="the SQuAD command line: evaluate and --help import no torch",
    evaluate=Subcommand("score predictions exactly as the official SQuAD scripts do", evaluate.add_arguments,
                        evaluate.run),
    finetune=finetune_subcommand("fine-tune a BERT folder on SQuAD with DeepSpeed, then score it", FinetuneConfig,
                                 load_finetune))
