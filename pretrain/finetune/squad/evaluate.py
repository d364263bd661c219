"""The ``evaluate`` command: score a predictions file as the official SQuAD v1.1 / v2.0 script does."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.finetune.squad.data import (
    SquadFormatError,
    SquadSet,
    load_na_probs,
    load_predictions,
    load_squad,
    quoted,
)
from pretrain.finetune.squad.metric import ScoreReport, evaluate_v1, evaluate_v2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", type=Path, help="SQuAD dataset JSON (official layout)")
    parser.add_argument("predictions", type=Path, help="predictions JSON: {question id: answer text}")
    parser.add_argument("--version", type=int, choices=(1, 2), default=1, help="1 = SQuAD v1.1 scoring, 2 = v2.0")
    parser.add_argument("--na-prob", type=Path, default=None, help="v2 only: {id: no-answer probability} JSON")
    parser.add_argument("--na-prob-thresh", type=float, default=1.0, help="v2 only: predict no answer above this")
    parser.add_argument("--out-file", type=Path, default=None, help="also write the result JSON here")


def score_files(
    data_path: Path,
    predictions_path: Path,
    version: int,
    na_prob_path: Path | None = None,
    na_prob_threshold: float = 1.0,
) -> ScoreReport:
    """Validate the files, then score. Raises SquadFormatError naming the file on bad input."""
    if version == 1 and na_prob_path is not None:
        raise SquadFormatError("--na-prob is a SQuAD v2.0 option: add --version 2")
    dataset = load_squad(data_path, check_offsets=False)
    predictions = load_predictions(predictions_path)
    check_overlap(dataset, predictions, predictions_path)
    if version == 1:
        impossible = next((e.qid for e in dataset.examples if e.is_impossible), None)
        if impossible is not None:
            raise SquadFormatError(
                f"{data_path}: question id {quoted(impossible)} is unanswerable (SQuAD v2.0): score it with --version 2"
            )
        if dataset.declared_version != "1.1":
            # The official v1.1 script warns, and still scores, when the file is another version.
            print(f"Evaluation expects v-1.1, but got dataset with v-{dataset.declared_version}", file=sys.stderr)
        return evaluate_v1(dataset.articles, predictions)
    na_probs = load_na_probs(na_prob_path) if na_prob_path is not None else None
    try:
        return evaluate_v2(dataset.articles, predictions, na_probs, na_prob_threshold)
    except ValueError as err:
        raise SquadFormatError(f"{na_prob_path}: {err}") from None


def check_overlap(dataset: SquadSet, predictions: dict[str, str], predictions_path: Path) -> None:
    """Refuse predictions that answer none of the dataset's questions: predictions for another set.

    The official scripts score such a file 0 and print one "Unanswered question" line per question
    (2,798 for the training subset): a silent wrong number. Extra ids next to real ones are ignored,
    as the official scripts do.
    """
    if any(example.qid in predictions for example in dataset.examples):
        return
    if not predictions:
        raise SquadFormatError(f"{predictions_path}: no predictions (an empty object); expected "
                               f"{{question id: answer text}} for the questions of {dataset.source}")
    raise SquadFormatError(
        f"{predictions_path}: none of its {len(predictions):,} question ids is in {dataset.source} "
        f"({len(dataset.examples):,} questions; e.g. {quoted(next(iter(predictions)))} is not): "
        "predictions for another dataset?"
    )


def unanswered_line(unanswered: list[str], total: int, predictions_path: Path) -> str:
    """One line for every question without a prediction (they score 0, as in the official scripts)."""
    return (f"{len(unanswered):,} of {total:,} questions have no prediction in {predictions_path} and score 0 "
            f"(first: {quoted(unanswered[0])})")


def run(args: argparse.Namespace) -> int:
    report = score_files(args.data, args.predictions, args.version, args.na_prob, args.na_prob_thresh)
    if report.unanswered:
        print(unanswered_line(report.unanswered, report.questions, args.predictions), file=sys.stderr)
    # v1.1 prints one line, v2.0 an indented object: as the official scripts do.
    print(json.dumps(report.scores) if args.version == 1 else json.dumps(report.scores, indent=2))
    if args.out_file is not None:
        atomic_write_json(args.out_file, report.scores)
    return 0
