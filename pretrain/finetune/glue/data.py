"""Read a GLUE task's data: the official TSV folder, a Hugging Face dataset saved to disk, or parquet files.

Every file is checked against its task's layout (pretrain/finetune/glue/tasks.py) before anything is
tokenised, and a file in the wrong format is one line naming the file and what was expected
(``GlueFormatError``; the command exits 2). No torch here: ``evaluate`` reads gold files with it.

Formats of ``--data DIR``, tried in this order:

* ``DIR/dataset_dict.json``: a ``DatasetDict`` saved with ``save_to_disk`` (``datasets.load_from_disk``);
* ``DIR/*.parquet``: one file (or shards) per split, named ``SPLIT.parquet`` or ``SPLIT-*.parquet``
  (the Hugging Face hub's layout of ``glue``, e.g. ``cola/train-00000-of-00001.parquet``);
* ``DIR/train.tsv`` and the task's dev file(s): the official GLUE folder (``glue_data/CoLA``).

The Hugging Face splits are ``train``, ``validation`` and ``test`` (MNLI: ``validation_matched``,
``validation_mismatched``, ``test_matched``, ``test_mismatched``); test labels of -1 mean unlabelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.errors import FinetuneFormatError
from pretrain.finetune.glue.tasks import Layout, Task

QUOTE_LIMIT = 60  # characters of a file's content quoted in an error message


class GlueFormatError(FinetuneFormatError):
    """A GLUE data, gold or predictions file (or folder) that cannot be used as it is."""


@dataclass(frozen=True)
class Example:
    index: str  # the file's index/id column, else the row's 0-based number
    text_a: str
    text_b: str | None
    label: int | float | None  # label id, STS-B score, or None (unlabelled test row)


@dataclass(frozen=True)
class GlueSet:
    source: str
    examples: list[Example]
    skipped: int = 0  # QQP rows with missing fields, dropped (tasks.Task.skip_short_rows)

    @property
    def labelled(self) -> bool:
        return bool(self.examples) and all(e.label is not None for e in self.examples)


@dataclass(frozen=True)
class TaskData:
    """A task's sets, validated: dev and test keyed by tasks.EvalSet.name (test only where present)."""

    train: GlueSet
    dev: dict[str, GlueSet]
    test: dict[str, GlueSet] = field(default_factory=dict)


def quoted(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error quotes what it found, never a whole file."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def read_lines(path: Path) -> list[str]:
    """The file's lines without their ends; only \\n ends a line (a sentence may hold \\x0b or \\u2028)."""
    try:
        text = path.read_bytes().decode("utf-8-sig")  # MRPC's msr_paraphrase_*.txt start with a BOM
    except FileNotFoundError:
        raise GlueFormatError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise GlueFormatError(f"{path}: not UTF-8 text ({err})") from None
    lines = [line.rstrip("\r") for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def float_or_nan(value: str) -> float:
    """A score as the files write it; NaN when it is no number (the callers say what they expected)."""
    try:
        return float(value)
    except ValueError:
        return math.nan


def parse_label(task: Task, value: str, where: str) -> int | float:
    if task.is_regression:
        score = float_or_nan(value)
        if not 0.0 <= score <= 5.0:  # also NaN
            raise GlueFormatError(f"{where}: score {quoted(value)} is not a number in [0, 5] ({task.title})")
        return score
    if value not in task.labels:
        raise GlueFormatError(f"{where}: label {quoted(value)} is not one of {', '.join(task.labels)} ({task.title})")
    return task.labels.index(value)


def choose_layout(path: Path, task: Task, layouts: tuple[Layout, ...], first: list[str], what: str) -> Layout:
    """The layout whose header (or, header-less, width) the first line matches; else one line saying what was expected."""
    for layout in layouts:
        if layout.header is not None and tuple(first) == layout.header:
            return layout
        if layout.header is None and len(first) == layout.width and not any(
            other.header is not None and first[: len(other.header)] == list(other.header)
            for other in (task.train, task.test, *task.dev)
        ):
            return layout
    expected = " or ".join(layout.describe() for layout in layouts)
    found = f"{len(first)} column(s): {quoted(' | '.join(first))}"
    raise GlueFormatError(f"{path}: not {task.title} {what} ({expected}); line 1 has {found}")


def read_tsv(path: Path, task: Task, layouts: tuple[Layout, ...], what: str) -> GlueSet:
    """One official GLUE TSV file of `task` in one of `layouts` (train, dev or test)."""
    lines = read_lines(path)
    if not lines:
        raise GlueFormatError(f"{path}: empty (expected {task.title} {what}: {layouts[0].describe()})")
    layout = choose_layout(path, task, layouts, lines[0].split("\t"), what)
    start = 1 if layout.header is not None else 0
    examples: list[Example] = []
    skipped = 0
    for number, line in enumerate(lines[start:], start=start + 1):
        fields = line.split("\t")
        if len(fields) != layout.width:
            if task.skip_short_rows and len(fields) < layout.width:
                skipped += 1
                continue
            raise GlueFormatError(f"{path} line {number}: {len(fields)} columns, expected {layout.width} "
                                  f"({task.title} {what}: {layout.describe()})")
        where = f"{path} line {number}"
        label = parse_label(task, fields[layout.label].strip(), where) if layout.label is not None else None
        index = fields[layout.index].strip() if layout.index is not None else str(len(examples))
        text_b = fields[layout.text_b] if layout.text_b is not None else None
        examples.append(Example(index, fields[layout.text_a], text_b, label))
    if not examples:
        raise GlueFormatError(f"{path}: no rows after the header ({task.title} {what})")
    check_unique(examples, str(path))
    return GlueSet(str(path), examples, skipped)


def check_unique(examples: list[Example], source: str) -> None:
    seen: set[str] = set()
    for example in examples:
        if example.index in seen:
            raise GlueFormatError(f"{source}: index {quoted(example.index)} appears twice")
        seen.add(example.index)


def rows_to_set(task: Task, rows: list[dict[str, Any]], source: str) -> GlueSet:
    """Hugging Face ``glue`` rows (text columns, ``label``, ``idx``) → a GlueSet; label -1 = unlabelled."""
    columns = [c for c in (*task.hf_text, "label") if c is not None]
    if not rows:
        raise GlueFormatError(f"{source}: no rows")
    missing = [c for c in columns if c not in rows[0]]
    if missing:
        raise GlueFormatError(f"{source}: no column(s) {', '.join(missing)} (expected the Hugging Face glue/"
                              f"{task.name} columns {', '.join(columns)}[, idx]; has {quoted(sorted(rows[0]))})")
    text_a, text_b = task.hf_text
    examples = []
    for number, row in enumerate(rows):
        label = row["label"]
        where = f"{source} row {number}"
        if isinstance(label, bool) or not isinstance(label, int | float) or label is None:
            raise GlueFormatError(f"{where}: label {quoted(label)} is not a number")
        if label == -1:
            parsed: int | float | None = None
        elif task.is_regression:
            parsed = parse_label(task, str(label), where)
        elif isinstance(label, int) and 0 <= label < len(task.labels):
            parsed = label
        else:
            raise GlueFormatError(f"{where}: label {quoted(label)} is not a label id 0..{len(task.labels) - 1} or -1")
        index = str(row.get("idx", number))
        examples.append(Example(index, str(row[text_a]), None if text_b is None else str(row[text_b]), parsed))
    check_unique(examples, source)
    return GlueSet(source, examples)


def parquet_files(folder: Path, split: str) -> list[Path]:
    return sorted({*folder.glob(f"{split}.parquet"), *folder.glob(f"{split}-*.parquet")})


def read_parquet(files: list[Path], task: Task, source: str) -> GlueSet:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path in files:
        try:
            rows += pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for a file that is not parquet
            raise GlueFormatError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    return rows_to_set(task, rows, source)


def layouts_expected(task: Task) -> str:
    files = ", ".join(["train.tsv", *(e.dev_file for e in task.evals)])
    tests = ", ".join(e.test_file for e in task.evals)
    return (f"the official GLUE {task.title} folder ({files}[, {tests}]), a Hugging Face dataset saved with "
            f"save_to_disk, or SPLIT.parquet / SPLIT-*.parquet files")


def load_task_data(task: Task, folder: Path) -> TaskData:
    """The task's train, dev and (where present) test sets from `folder`, in whichever format it holds."""
    if not folder.is_dir():
        raise GlueFormatError(f"--data {folder}: not a folder (expected {layouts_expected(task)})")
    if (folder / "dataset_dict.json").is_file():
        return load_hf_disk(task, folder)
    if any(folder.glob("*.parquet")):
        return load_parquet_folder(task, folder)
    if not (folder / "train.tsv").is_file():
        raise GlueFormatError(f"--data {folder}: no train.tsv, dataset_dict.json or parquet files "
                              f"(expected {layouts_expected(task)})")
    train = read_tsv(folder / "train.tsv", task, (task.train,), "train.tsv")
    dev = {e.name: read_tsv(folder / e.dev_file, task, task.dev, e.dev_file) for e in task.evals}
    test = {e.name: read_tsv(folder / e.test_file, task, (task.test,), e.test_file)
            for e in task.evals if (folder / e.test_file).is_file()}
    return TaskData(train, dev, test)


def load_parquet_folder(task: Task, folder: Path) -> TaskData:
    def split(name: str, required: bool) -> GlueSet | None:
        files = parquet_files(folder, name)
        if not files:
            if required:
                raise GlueFormatError(f"--data {folder}: no {name}.parquet or {name}-*.parquet "
                                      f"(expected the Hugging Face glue/{task.name} splits as parquet)")
            return None
        return read_parquet(files, task, f"{folder}/{name}*.parquet")

    train = split("train", True)
    assert train is not None
    dev = {e.name: split(e.dev_split, True) for e in task.evals}
    test = {e.name: split(e.test_split, False) for e in task.evals}
    return TaskData(train, {k: v for k, v in dev.items() if v is not None},
                    {k: v for k, v in test.items() if v is not None})


def load_hf_disk(task: Task, folder: Path) -> TaskData:
    import datasets

    try:
        saved = datasets.load_from_disk(str(folder))
    except Exception as err:  # a damaged save: datasets raises several types
        raise GlueFormatError(f"--data {folder}: datasets.load_from_disk failed ({type(err).__name__}: {err})") from None
    if not isinstance(saved, datasets.DatasetDict):
        raise GlueFormatError(f"--data {folder}: a single Dataset; expected a DatasetDict with the splits train, "
                              f"{', '.join(e.dev_split for e in task.evals)}")

    def split(name: str) -> GlueSet:
        return rows_to_set(task, saved[name].to_list(), f"{folder}[{name}]")

    for name in ("train", *(e.dev_split for e in task.evals)):
        if name not in saved:
            raise GlueFormatError(f"--data {folder}: no split {name!r} (has {', '.join(saved)}; expected the "
                                  f"Hugging Face glue/{task.name} splits)")
    dev = {e.name: split(e.dev_split) for e in task.evals}
    test = {e.name: split(e.test_split) for e in task.evals if e.test_split in saved}
    return TaskData(split("train"), dev, test)


def load_gold(task: Task, path: Path) -> GlueSet:
    """A labelled file to score against: a dev TSV in the task's layout, or a parquet file of its split."""
    if path.suffix == ".parquet":
        gold = read_parquet([path], task, str(path))
    else:
        gold = read_tsv(path, task, task.dev, "dev file")
    if not gold.labelled:
        raise GlueFormatError(f"{path}: has unlabelled rows (a test set?): the gold file must be labelled")
    return gold
