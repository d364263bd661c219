"""``python -m pretrain.finetune.glue {evaluate,finetune} ...``: the GLUE command line (evaluate and --help import
no torch; finetune imports it when it runs)."""

from __future__ import annotations

import sys

from pretrain.finetune.common import FinetuneCommand
from pretrain.finetune.glue.data import GlueFormatError

COMMAND = FinetuneCommand(
    package="pretrain.finetune.glue",
    description=__doc__,
    evaluate_help="score a GLUE predictions file against the task's labelled dev file",
    finetune_help="fine-tune a BERT folder on a GLUE task with DeepSpeed, N seeds",
    format_error=GlueFormatError,
)


def main(argv: list[str] | None = None) -> int:
    return COMMAND.main(argv)


if __name__ == "__main__":
    sys.exit(main())
