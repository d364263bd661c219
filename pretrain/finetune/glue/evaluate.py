"""The ``evaluate`` command: score a GLUE predictions file against a labelled (dev) file. No torch here.

    python -m pretrain.finetune.glue evaluate --task cola glue_data/CoLA/dev.tsv runs/glue/cola/seed-42/dev/CoLA.tsv

GOLD is a labelled file of the task: the official dev TSV (dev.tsv; MNLI: dev_matched.tsv or
dev_mismatched.tsv) or a parquet file of the Hugging Face split. PREDICTIONS is in the GLUE
submission format (pretrain/finetune/glue/submission.py). Rows are matched by index (the file's index/id
column, else the row number); every gold row needs a prediction, and extra indices are ignored.
Prints the task's metrics as one JSON line, in percent.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.finetune.glue.data import GlueFormatError, GlueSet, load_gold, quoted
from pretrain.finetune.glue.metric import score
from pretrain.finetune.glue.submission import read_predictions
from pretrain.finetune.glue.tasks import TASKS, Task, task_named


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", required=True, help=f"GLUE task: {', '.join(t.name for t in TASKS.values())} "
                                                      "(or GLUE's spelling: CoLA, SST-2, STS-B, ...)")
    parser.add_argument("gold", type=Path, help="labelled file: the task's dev TSV, or a parquet file of its split")
    parser.add_argument("predictions", type=Path, help="predictions TSV in the GLUE submission format "
                                                       "(index<TAB>prediction)")
    parser.add_argument("--out-file", type=Path, default=None, help="also write the scores JSON here")


def aligned(gold: GlueSet, predictions: dict[str, int | float], path: Path) -> list[int | float]:
    """The predictions in gold order; a gold row without one is refused (no silent zero)."""
    missing = [e.index for e in gold.examples if e.index not in predictions]
    if len(missing) == len(gold.examples):
        raise GlueFormatError(f"{path}: none of its {len(predictions):,} indices is in {gold.source} "
                              f"({len(gold.examples):,} rows; e.g. {quoted(next(iter(predictions)))} is not): "
                              "predictions for another set?")
    if missing:
        raise GlueFormatError(f"{path}: {len(missing):,} of {len(gold.examples):,} rows of {gold.source} have no "
                              f"prediction (first: index {quoted(missing[0])})")
    return [predictions[e.index] for e in gold.examples]


def score_files(task: Task, gold_path: Path, predictions_path: Path) -> dict[str, float]:
    gold = load_gold(task, gold_path)
    predicted = aligned(gold, read_predictions(task, predictions_path), predictions_path)
    labels = [e.label for e in gold.examples]
    return score(task, labels, predicted)  # type: ignore[arg-type]  # labelled: no None left


def run(args: argparse.Namespace) -> int:
    try:
        task = task_named(args.task)
    except ValueError as err:
        raise GlueFormatError(str(err)) from None
    scores = score_files(task, args.gold, args.predictions)
    print(json.dumps(scores))
    if args.out_file is not None:
        atomic_write_json(args.out_file, scores)
    return 0
