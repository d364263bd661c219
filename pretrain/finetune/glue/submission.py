"""Prediction files in the GLUE server's submission format: ``index<TAB>prediction`` under that header.

One file per set, named as the server expects (CoLA.tsv, SST-2.tsv, MRPC.tsv, STS-B.tsv, QQP.tsv,
MNLI-m.tsv, MNLI-mm.tsv, QNLI.tsv, RTE.tsv, WNLI.tsv). A classification prediction is the label
as the task's files write it (``0``/``1``, ``entailment``/``not_entailment``, ``entailment``/
``neutral``/``contradiction``); STS-B's is the predicted score. The fine-tune writes dev
predictions in the same format, so ``glue evaluate`` reads both. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from data_prep.shard_format.atomic_io import atomic_write_bytes
from pretrain.finetune.glue.data import GlueFormatError, float_or_nan, quoted, read_lines
from pretrain.finetune.glue.tasks import Task

HEADER = ("index", "prediction")


def format_prediction(task: Task, value: float) -> str:
    """A label id as its name, or an STS-B score (repr: the float round-trips exactly)."""
    return repr(float(value)) if task.is_regression else task.labels[int(value)]


def write_predictions(task: Task, path: Path, indices: Sequence[str], values: Sequence[float]) -> None:
    """Written atomically: a reader (or the GLUE server's zip) never sees half a file."""
    lines = ["\t".join(HEADER)] + [f"{index}\t{format_prediction(task, value)}"
                                   for index, value in zip(indices, values, strict=True)]
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))


def read_predictions(task: Task, path: Path) -> dict[str, int | float]:
    """``{index: label id or score}``; refused in one line naming the file when it is not in the format."""
    lines = read_lines(path)
    expected = "the GLUE submission format: a header 'index<TAB>prediction', then one row per example"
    if not lines or tuple(lines[0].split("\t")) != HEADER:
        found = quoted(lines[0]) if lines else "an empty file"
        raise GlueFormatError(f"{path}: not {expected}; line 1 is {found}")
    predictions: dict[str, int | float] = {}
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if len(fields) != 2:
            raise GlueFormatError(f"{path} line {number}: {len(fields)} columns, expected 2 (index, prediction)")
        index, value = fields[0].strip(), fields[1].strip()
        if index in predictions:
            raise GlueFormatError(f"{path} line {number}: index {quoted(index)} appears twice")
        predictions[index] = parse_prediction(task, value, f"{path} line {number}")
    if not predictions:
        raise GlueFormatError(f"{path}: no predictions after the header")
    return predictions


def parse_prediction(task: Task, value: str, where: str) -> int | float:
    if task.is_regression:
        score = float_or_nan(value)
        if not math.isfinite(score):
            raise GlueFormatError(f"{where}: prediction {quoted(value)} is not a number ({task.title} scores)")
        return score
    if value not in task.labels:
        raise GlueFormatError(f"{where}: prediction {quoted(value)} is not one of {', '.join(task.labels)} "
                              f"({task.title} labels)")
    return task.labels.index(value)
