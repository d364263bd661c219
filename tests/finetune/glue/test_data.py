"""Every task's official layout read as GLUE writes it, Hugging Face saves and parquet, and wrong files refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.finetune.glue.__main__ import main
from pretrain.finetune.glue.data import load_task_data
from pretrain.finetune.glue.tasks import TASKS, task_named
from tests.finetune.glue.glue_files import TITLES, write_task


@pytest.mark.parametrize("title", TITLES)
def test_every_tasks_official_folder_is_read_with_its_columns(title: str, tmp_path: Path) -> None:
    data = load_task_data(task_named(title), write_task(tmp_path / title, title, train=8, dev=6, test=4))
    task = task_named(title)
    assert len(data.train.examples) == 8 and data.train.labelled
    assert set(data.dev) == set(data.test) == {e.name for e in task.evals}
    for dev in data.dev.values():
        assert len(dev.examples) == 6 and dev.labelled
        first_index = 133273 if title == "QQP" else 0  # QQP's id column; the others' index or row number
        assert [e.index for e in dev.examples] == [str(first_index + i) for i in range(6)]
    for test in data.test.values():
        assert len(test.examples) == 4 and not any(e.label is not None for e in test.examples)
    first = data.train.examples[0]
    assert first.text_a.strip().endswith((".", "?")) and (first.text_b is None) == (title in ("CoLA", "SST-2"))
    if title == "STS-B":
        assert [e.label for e in data.train.examples[:3]] == [0.0, 0.7, 1.4]
    elif title == "MNLI":  # HF's ids: entailment 0, neutral 1, contradiction 2
        assert [e.label for e in data.train.examples[:3]] == [0, 1, 2]
    elif title == "QQP":
        assert data.train.examples[1].index == "133274"  # QQP's id column
    else:
        assert [e.label for e in data.train.examples[:2]] == [0, 1]


def test_mrpc_with_a_byte_order_mark_and_qqp_short_rows(tmp_path: Path) -> None:
    mrpc = write_task(tmp_path / "MRPC", "MRPC")
    (mrpc / "train.tsv").write_bytes(b"\xef\xbb\xbf" + (mrpc / "train.tsv").read_bytes())
    assert len(load_task_data(TASKS["mrpc"], mrpc).train.examples) == 8
    qqp = write_task(tmp_path / "QQP", "QQP")
    with (qqp / "train.tsv").open("a", encoding="utf-8") as handle:
        handle.write("999\t1\t2\tHow is the race held?\n")  # a row with missing fields, as in QQP's release
    data = load_task_data(TASKS["qqp"], qqp)
    assert len(data.train.examples) == 8 and data.train.skipped == 1


def _hf_dataset_dict(title: str, folder: Path):
    """The TSV folder's rows in the Hugging Face glue/TASK layout (columns, split names, -1 test labels)."""
    import datasets

    task = task_named(title)
    data = load_task_data(task, folder)
    text_a, text_b = task.hf_text

    def table(glue_set):
        rows = {text_a: [e.text_a for e in glue_set.examples],
                "label": [-1 if e.label is None else e.label for e in glue_set.examples],
                "idx": [int(e.index) for e in glue_set.examples]}
        if text_b is not None:
            rows[text_b] = [e.text_b for e in glue_set.examples]
        return datasets.Dataset.from_dict(rows)

    splits = {"train": table(data.train)}
    for e in task.evals:
        splits[e.dev_split] = table(data.dev[e.name])
        splits[e.test_split] = table(data.test[e.name])
    return datasets.DatasetDict(splits), data


@pytest.mark.parametrize("title", ["MNLI", "STS-B"])
def test_hugging_face_save_to_disk_and_parquet_give_the_same_sets(title: str, tmp_path: Path) -> None:
    dataset, tsv = _hf_dataset_dict(title, write_task(tmp_path / "tsv", title))
    dataset.save_to_disk(str(tmp_path / "disk"))
    (tmp_path / "parquet").mkdir()
    for split, table in dataset.items():
        table.to_parquet(str(tmp_path / "parquet" / f"{split}-00000-of-00001.parquet"))
    for folder in (tmp_path / "disk", tmp_path / "parquet"):
        data = load_task_data(task_named(title), folder)
        assert data.train.examples == tsv.train.examples
        assert data.dev == {k: v.examples for k, v in tsv.dev.items()} or all(
            data.dev[k].examples == tsv.dev[k].examples for k in tsv.dev)
        assert all(data.test[k].examples == tsv.test[k].examples for k in tsv.test)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 400, captured.err
    return lines[0]


def _finetune_argv(task: str, data: Path, model: Path, tmp_path: Path) -> list[str]:
    return ["finetune", "--task", task, "--model", str(model), "--data", str(data), "--out", str(tmp_path / "out")]


@pytest.mark.parametrize(("title", "damage", "expected"), [
    ("CoLA", lambda f: (f / "dev.tsv").write_text("index\tsentence\n0\tThe race ends.\n"),
     "dev.tsv: not CoLA dev.tsv (no header, 4 tab-separated columns); line 1 has 2 column(s): "
     "'index | sentence'"),
    ("MRPC", lambda f: (f / "train.tsv").write_text("sentence\tlabel\nthe race \t1\n"),
     "train.tsv: not MRPC train.tsv (5 tab-separated columns under the header Quality | #1 ID | #2 ID | "
     "#1 String | #2 String); line 1 has 2 column(s): 'sentence | label'"),
    ("STS-B", lambda f: (f / "dev.tsv").write_text((f / "dev.tsv").read_text().replace("\t0.700", "\thigh")),
     "dev.tsv line 3: score 'high' is not a number in [0, 5] (STS-B)"),
    ("RTE", lambda f: (f / "train.tsv").write_text((f / "train.tsv").read_text().replace("\tnot_entailment", "\t1")),
     "train.tsv line 3: label '1' is not one of entailment, not_entailment (RTE)"),
    ("SST-2", lambda f: (f / "train.tsv").write_text("sentence\tlabel\nthe race \t1\tfoo\n"),
     "train.tsv line 2: 3 columns, expected 2 (SST-2 train.tsv: 2 tab-separated columns under the header "
     "sentence | label)"),
    ("MNLI", lambda f: (f / "dev_mismatched.tsv").unlink(), "dev_mismatched.tsv: no such file"),
])
def test_a_file_in_the_wrong_format_is_one_line_naming_it(title: str, damage, expected: str, tmp_path: Path,
                                                          tiny_export: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_task(tmp_path / title, title)
    damage(folder)
    line = _refused(capsys, _finetune_argv(title, folder, tiny_export, tmp_path)).replace(str(folder) + "/", "")
    assert line.startswith("error: ") and expected in line, line


def test_an_empty_folder_says_what_was_expected(tmp_path: Path, tiny_export: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(capsys, _finetune_argv("mnli", tmp_path, tiny_export, tmp_path))
    assert f"--data {tmp_path}: no train.tsv, dataset_dict.json or parquet files (expected the official GLUE MNLI " \
           "folder (train.tsv, dev_matched.tsv, dev_mismatched.tsv[, test_matched.tsv, test_mismatched.tsv])" in line


def test_wrong_predictions_are_refused_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_task(tmp_path / "QNLI", "QNLI", dev=4)
    gold = str(folder / "dev.tsv")
    predictions = tmp_path / "QNLI.tsv"
    predictions.write_text("index\tprediction\n0\tentailment\n1\tneutral\n")
    assert _refused(capsys, ["evaluate", "--task", "qnli", gold, str(predictions)]) == (
        f"error: {predictions} line 3: prediction 'neutral' is not one of entailment, not_entailment (QNLI labels)")
    predictions.write_text("index\tprediction\n0\tentailment\n1\tentailment\n")
    assert _refused(capsys, ["evaluate", "--task", "qnli", gold, str(predictions)]) == (
        f"error: {predictions}: 2 of 4 rows of {gold} have no prediction (first: index '2')")
    predictions.write_text("index\tprediction\n70\tentailment\n")
    assert "predictions for another set?" in _refused(capsys, ["evaluate", "--task", "qnli", gold, str(predictions)])
    assert _refused(capsys, ["evaluate", "--task", "glue", gold, str(predictions)]).startswith(
        "error: --task 'glue': not a GLUE task (one of CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, WNLI)")
