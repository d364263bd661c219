"""Checkpoint -> Hugging Face model folder, verified, with its model card.

    python -m pretrain.export CHECKPOINT OUT [--tag TAG]

CHECKPOINT is a checkpoint folder (its `latest` is used) or one tag folder. OUT is new, an empty folder or an
earlier export (it holds export_info.json), and neither holds nor lies inside the checkpoint: anything else is
refused in one line before any work, and an earlier export is replaced only once the new one is complete. The fp32 weights are consolidated
from the ZeRO partitions of every rank (stages 0-3, pretrain/checkpointing/checkpoint.py) and written as a
verified folder (pretrain/checkpointing/export.py); the card's facts are gathered from the checkpoint and its run
folder (pretrain/report/model_card.py). The driver's phase-end export (pretrain/train.py) is this same function.

It sits above both floors it joins: the export writes folders and knows nothing of the run folder's records, the
card reads them; a checkpoint module that imported the card would be an import running back up the floors.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint folder (uses its 'latest') or one tag folder")
    parser.add_argument("out", help="output folder for the Hugging Face model")
    parser.add_argument("--tag", default=None, help="checkpoint tag to export instead of 'latest'")
    return parser


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    _parser().parse_args()  # prints the usage and exits before torch and transformers are imported

from pathlib import Path
from typing import Any

from pretrain.checkpointing.checkpoint import consolidated_state_dict, read_run_config, split_checkpoint_path
from pretrain.checkpointing.export import ExportTargetError, check_export_target, export_state_dict
from pretrain.checkpointing.export_tokenizer import TokenizerExportError
from pretrain.report.model_card import ExportCard, card_facts


def export_checkpoint(checkpoint: str | Path, out: str | Path, tag: str | None = None) -> dict[str, Any]:
    """The checkpoint's (its `latest`, or `tag`) verified folder at `out`, its card from the run that wrote it.
    An `out` that holds anything but an earlier export, or holds or lies in the checkpoint, is refused first
    (ExportTargetError), before the weights are read."""
    root, found_tag = split_checkpoint_path(checkpoint)
    check_export_target(Path(out), root)
    tag = tag or found_tag
    run_config = read_run_config(root, tag)
    state_dict = consolidated_state_dict(root, tag)
    return export_state_dict(state_dict, run_config["resolved"], Path(out), source=str(root / tag),
                             write_card=ExportCard(card_facts(root, tag, run_config)))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        info = export_checkpoint(args.checkpoint, args.out, args.tag)
    except (FileNotFoundError, ExportTargetError, ValueError, RuntimeError, TokenizerExportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {info['source']} -> {args.out} (max |logit diff| {info['max_abs_logit_difference']:.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
