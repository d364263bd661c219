"""``python -m pretrain.finetune.squad {evaluate,finetune} ...``: the SQuAD command line (evaluate and --help import
no torch; finetune imports it when it runs)."""

from __future__ import annotations

import sys

from pretrain.finetune.common import FinetuneCommand
from pretrain.finetune.squad.data import SquadFormatError

COMMAND = FinetuneCommand(
    package="pretrain.finetune.squad",
    description=__doc__,
    evaluate_help="score predictions exactly as the official SQuAD scripts do",
    finetune_help="fine-tune a BERT folder on SQuAD with DeepSpeed, then score it",
    format_error=SquadFormatError,
)


def main(argv: list[str] | None = None) -> int:
    return COMMAND.main(argv)


if __name__ == "__main__":
    sys.exit(main())
