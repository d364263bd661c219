"""The nine GLUE tasks: each one's files, columns, header rules, labels, metrics and submission names.

Everything a reader or a scorer must know about a task is declared here once, as data, so that
``data.py`` has one reader for all of them and a task's quirks are visible side by side. The
layouts are those of the official GLUE download (``download_glue_data.py``, the ``glue_data/TASK``
folders) and of the Hugging Face ``glue`` dataset (its column names, split names and label ids).

Quirks the layouts encode:

* CoLA's train.tsv / dev.tsv have no header and 4 columns (source, label, the author's original
  mark, sentence); its test.tsv has a header (``index sentence``).
* MRPC's train/dev header is ``Quality #1 ID #2 ID #1 String #2 String`` (the label comes first);
  Microsoft's own ``msr_paraphrase_*.txt`` files start with a UTF-8 byte-order mark, which we drop.
* STS-B's label is a float similarity score in [0, 5] (a regression head, num_labels=1).
* MNLI has two dev and two test sets (matched and mismatched genres); its dev files carry five
  annotator labels before ``gold_label``, its train file one.
* QQP's train/dev identify a row by ``id`` (the others by ``index``; CoLA, SST-2 and MRPC's
  train/dev have no index column, and a row's index is then its 0-based number in the file).
* The label ids follow the Hugging Face dataset (MNLI: entailment 0, neutral 1, contradiction 2;
  QNLI/RTE: entailment 0, not_entailment 1; the 0/1 tasks: as written); the names are what the GLUE
  files and the GLUE server's submission files use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """The shape of one TSV file: its header (None: no header row), width and which column holds what."""

    header: tuple[str, ...] | None
    width: int
    text_a: int
    text_b: int | None = None
    label: int | None = None
    index: int | None = None  # None: the row's 0-based number

    def describe(self) -> str:
        if self.header is None:
            return f"no header, {self.width} tab-separated columns"
        return f"{self.width} tab-separated columns under the header {' | '.join(self.header)}"


@dataclass(frozen=True)
class EvalSet:
    """One scored set (dev) and its unlabelled twin (test), by file and by Hugging Face split."""

    name: str  # "dev", or MNLI's "matched" / "mismatched"
    dev_file: str
    dev_split: str
    test_file: str
    test_split: str
    submission: str  # the file name the GLUE server expects for this set's test predictions


@dataclass(frozen=True)
class Task:
    name: str  # what --task takes: cola, sst2, ...
    title: str  # GLUE's name and the official folder name: CoLA, SST-2, ...
    labels: tuple[str, ...]  # label names by id; () for the regression task (STS-B)
    metrics: tuple[str, ...]  # GLUE's metrics for this task, in the leaderboard's order
    train: Layout
    dev: tuple[Layout, ...]  # the layouts a dev (gold) file may have
    test: Layout
    evals: tuple[EvalSet, ...]
    hf_text: tuple[str, str | None]  # the Hugging Face dataset's text columns
    skip_short_rows: bool = False  # QQP: drop the rare row with missing fields, as transformers does

    @property
    def is_regression(self) -> bool:
        return not self.labels

    @property
    def num_labels(self) -> int:
        return len(self.labels) or 1


def _single(name: str, dev_file: str = "dev.tsv", test_file: str = "test.tsv") -> tuple[EvalSet, ...]:
    return (EvalSet("dev", dev_file, "validation", test_file, "test", f"{name}.tsv"),)


BINARY = ("0", "1")
ENTAILMENT = ("entailment", "not_entailment")
PAIR_TEST = Layout(("index", "sentence1", "sentence2"), 3, 1, 2, index=0)
PAIR_TRAIN = Layout(("index", "sentence1", "sentence2", "label"), 4, 1, 2, label=3, index=0)
MRPC_STRINGS = ("#1 ID", "#2 ID", "#1 String", "#2 String")
STSB_COLUMNS = ("index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2")
MNLI_COLUMNS = ("index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                "sentence1_parse", "sentence2_parse", "sentence1", "sentence2")
MNLI_TRAIN = Layout((*MNLI_COLUMNS, "label1", "gold_label"), 12, 8, 9, label=11, index=0)
MNLI_DEV = Layout((*MNLI_COLUMNS, "label1", "label2", "label3", "label4", "label5", "gold_label"), 16, 8, 9,
                  label=15, index=0)
CLASSIFICATION_PAIR_METRICS = ("f1", "accuracy")

TASKS: dict[str, Task] = {task.name: task for task in (
    Task("cola", "CoLA", BINARY, ("matthews_correlation",),
         train=Layout(None, 4, 3, label=1), dev=(Layout(None, 4, 3, label=1),),
         test=Layout(("index", "sentence"), 2, 1, index=0), evals=_single("CoLA"), hf_text=("sentence", None)),
    Task("sst2", "SST-2", BINARY, ("accuracy",),
         train=Layout(("sentence", "label"), 2, 0, label=1), dev=(Layout(("sentence", "label"), 2, 0, label=1),),
         test=Layout(("index", "sentence"), 2, 1, index=0), evals=_single("SST-2"), hf_text=("sentence", None)),
    Task("mrpc", "MRPC", BINARY, CLASSIFICATION_PAIR_METRICS,
         train=Layout(("Quality", *MRPC_STRINGS), 5, 3, 4, label=0),
         dev=(Layout(("Quality", *MRPC_STRINGS), 5, 3, 4, label=0),),
         test=Layout(("index", *MRPC_STRINGS), 5, 3, 4, index=0), evals=_single("MRPC"),
         hf_text=("sentence1", "sentence2")),
    Task("stsb", "STS-B", (), ("pearson", "spearman"),
         train=Layout((*STSB_COLUMNS, "score"), 10, 7, 8, label=9, index=0),
         dev=(Layout((*STSB_COLUMNS, "score"), 10, 7, 8, label=9, index=0),),
         test=Layout(STSB_COLUMNS, 9, 7, 8, index=0), evals=_single("STS-B"), hf_text=("sentence1", "sentence2")),
    Task("qqp", "QQP", BINARY, CLASSIFICATION_PAIR_METRICS,
         train=Layout(("id", "qid1", "qid2", "question1", "question2", "is_duplicate"), 6, 3, 4, label=5, index=0),
         dev=(Layout(("id", "qid1", "qid2", "question1", "question2", "is_duplicate"), 6, 3, 4, label=5, index=0),),
         test=Layout(("id", "question1", "question2"), 3, 1, 2, index=0), evals=_single("QQP"),
         hf_text=("question1", "question2"), skip_short_rows=True),
    Task("mnli", "MNLI", ("entailment", "neutral", "contradiction"), ("accuracy",),
         train=MNLI_TRAIN, dev=(MNLI_DEV,), test=Layout(MNLI_COLUMNS, 10, 8, 9, index=0),
         evals=(EvalSet("matched", "dev_matched.tsv", "validation_matched", "test_matched.tsv", "test_matched",
                        "MNLI-m.tsv"),
                EvalSet("mismatched", "dev_mismatched.tsv", "validation_mismatched", "test_mismatched.tsv",
                        "test_mismatched", "MNLI-mm.tsv")),
         hf_text=("premise", "hypothesis")),
    Task("qnli", "QNLI", ENTAILMENT, ("accuracy",),
         train=Layout(("index", "question", "sentence", "label"), 4, 1, 2, label=3, index=0),
         dev=(Layout(("index", "question", "sentence", "label"), 4, 1, 2, label=3, index=0),),
         test=Layout(("index", "question", "sentence"), 3, 1, 2, index=0), evals=_single("QNLI"),
         hf_text=("question", "sentence")),
    Task("rte", "RTE", ENTAILMENT, ("accuracy",), train=PAIR_TRAIN, dev=(PAIR_TRAIN,), test=PAIR_TEST,
         evals=_single("RTE"), hf_text=("sentence1", "sentence2")),
    Task("wnli", "WNLI", BINARY, ("accuracy",), train=PAIR_TRAIN, dev=(PAIR_TRAIN,), test=PAIR_TEST,
         evals=_single("WNLI"), hf_text=("sentence1", "sentence2")),
)}

# --task also takes GLUE's own spelling (CoLA, SST-2, STS-B, ...), any case.
ALIASES = {alias: name for name, task in TASKS.items() for alias in (name, task.title.lower())}


def task_named(name: str) -> Task:
    """The task for a --task value; ValueError naming the choices."""
    key = ALIASES.get(name.strip().lower())
    if key is None:
        raise ValueError(f"--task {name!r}: not a GLUE task (one of {', '.join(t.title for t in TASKS.values())})")
    return TASKS[key]
