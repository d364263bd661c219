"""``python -m pretrain.squad {evaluate,finetune} ...``: the SQuAD command line."""

from __future__ import annotations

import argparse
import sys

from pretrain.squad import evaluate
from pretrain.squad.data import SquadFormatError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pretrain.squad", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    evaluate.add_arguments(
        commands.add_parser("evaluate", help="score predictions exactly as the official SQuAD scripts do")
    )
    # The finetune arguments live beside the training code but must not import torch here:
    # `evaluate` has to stay a light, torch-free command.
    from pretrain.squad import finetune_args

    finetune_args.add_arguments(
        commands.add_parser("finetune", help="fine-tune a BERT folder on SQuAD with DeepSpeed, then score it")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "evaluate":
            return evaluate.run(args)
        from pretrain.squad import finetune  # torch, transformers, deepspeed: only for this command

        return finetune.run(args)
    except SquadFormatError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
