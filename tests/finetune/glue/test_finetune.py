"""`glue finetune` end to end on CPU (one process, in-process DeepSpeed engines): every task's format, 2 seeds."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.finetune.glue.__main__ import main
from pretrain.finetune.glue.tasks import task_named
from tests.finetune.glue.glue_files import SENTENCES, TITLES, write_task
from tests.finetune.glue.test_data import _hf_dataset_dict
from tests.finetune.pipeline_contract import check_text_classification
from tests.support.launching import REPO_ROOT, child_env

# Tiny and quick: the shipped DeepSpeed JSON (squad_adamw_zero1.json, the default) with small flags.
QUICK = ["--seeds", "2", "--max-steps", "2", "--batch-size", "4", "--lr", "1e-3", "--max-seq-length", "32",
         "--log-every", "1", "--save-model"]


def _finetune(model: Path, task: str, data: Path, out: Path, *flags: str) -> dict:
    assert main(["finetune", "--task", task, "--model", str(model), "--data", str(data), "--out", str(out),
                 *flags]) == 0
    return json.loads((out / "results.json").read_text())


def _check_outputs(title: str, results: dict, out: Path, data: Path | None,
                   capsys: pytest.CaptureFixture[str]) -> None:
    task = task_named(title)
    assert results["seeds"] == [42, 43] and results["task"] == title and results["world_size"] == 1
    assert results["precision"] == "fp32" and results["optimizer"] == "AdamW" and results["train_steps"] == 2
    for eval_set in task.evals:
        per_seed = [run["scores"][eval_set.name] for run in results["runs"]]
        assert set(per_seed[0]) == {*task.metrics, "score"}
        for metric in per_seed[0]:
            assert results["median"][eval_set.name][metric] == pytest.approx(
                statistics.median(scores[metric] for scores in per_seed), nan_ok=True)
        for seed in (42, 43):
            dev = (out / f"seed-{seed}" / "dev" / eval_set.submission).read_text().splitlines()
            assert dev[0] == "index\tprediction" and len(dev) == 1 + results["dev_examples"][eval_set.name]
            values = [line.split("\t")[1] for line in dev[1:]]
            if task.is_regression:
                assert all(isinstance(float(v), float) for v in values)
            else:
                assert set(values) <= set(task.labels)
        # The GLUE server's file names, from the seed best on dev; what `glue evaluate` says equals results.json.
        test = (out / "submission" / eval_set.submission).read_text().splitlines()
        assert test[0] == "index\tprediction" and len(test) == 1 + results["test_examples"][eval_set.name]
        if data is not None:
            seed = results["runs"][1]
            assert main(["evaluate", "--task", title, str(data / eval_set.dev_file),
                         str(out / "seed-43" / "dev" / eval_set.submission)]) == 0
            assert json.loads(capsys.readouterr().out.splitlines()[-1]) == pytest.approx(
                seed["scores"][eval_set.name], nan_ok=True)
    assert results["submission"] == sorted(e.submission for e in task.evals)
    assert list((out / "tensorboard" / "seed-43").glob("events.out.tfevents.*"))
    assert results["vocab_check"]["unk_share"] == 0.0 and results["vocab_check"]["tokens"] > 0
    # --save-model: the best seed's model, and the saved folder's contract (issue 40): it labels a sentence (pair)
    # with the task's labels through transformers' Auto classes and pipeline.
    assert (out / "model" / "config.json").is_file() and not list(out.glob("seed-*/model"))
    pairs = [(a, b if task.train.text_b is not None else None) for a, b in zip(SENTENCES[:3], SENTENCES[3:6],
                                                                                strict=True)]
    check_text_classification(out / "model", task, pairs)


@pytest.mark.parametrize("title", TITLES)
def test_every_tasks_official_files_end_to_end_with_two_seeds(title: str, tiny_export: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = write_task(tmp_path / title, title)
    results = _finetune(tiny_export, title, data, tmp_path / "out", *QUICK)
    capsys.readouterr()
    _check_outputs(title, results, tmp_path / "out", data, capsys)


@pytest.mark.parametrize(("title", "form"), [("MNLI", "disk"), ("STS-B", "parquet")])
def test_hugging_face_datasets_end_to_end_with_two_seeds(title: str, form: str, tiny_export: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    dataset, _ = _hf_dataset_dict(title, write_task(tmp_path / "tsv", title))
    folder = tmp_path / form
    if form == "disk":
        dataset.save_to_disk(str(folder))
    else:
        folder.mkdir()
        for split, table in dataset.items():
            table.to_parquet(str(folder / f"{split}.parquet"))
    results = _finetune(tiny_export, title, folder, tmp_path / "out", *QUICK)
    _check_outputs(title, results, tmp_path / "out", None, capsys)


def test_a_tiny_export_learns_a_learnable_task_well_above_chance(tiny_export: Path, tmp_path: Path) -> None:
    """SST-2's format, label 1 iff the sentence says 'bread': chance is 50% accuracy on the balanced dev set."""
    rng = random.Random(0)
    fillers = "the tower race bridge lamp river mill boats sailors morning day old stone red white".split()

    def sentence(label: int) -> str:
        words = rng.sample(fillers, 5)
        words.insert(rng.randrange(6), "bread" if label else "rye")
        return " ".join(words)

    folder = tmp_path / "SST-2"
    folder.mkdir()
    for name, count in (("train.tsv", 96), ("dev.tsv", 40)):
        lines = [f"{sentence(i % 2)} \t{i % 2}" for i in range(count)]
        (folder / name).write_text("sentence\tlabel\n" + "\n".join(lines) + "\n")
    results = _finetune(tiny_export, "sst2", folder, tmp_path / "out", "--max-steps", "50", "--batch-size", "16",
                        "--lr", "3e-3", "--max-seq-length", "16", "--log-every", "20", "--warmup-fraction", "0.1")
    accuracy = results["runs"][0]["scores"]["dev"]["accuracy"]
    assert accuracy >= 85.0, f"dev accuracy {accuracy}: no better than chance (50)"


def test_a_deepspeed_json_that_sets_the_lr_is_refused_naming_the_flag(tiny_export: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    shipped = json.loads((REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json").read_text())
    shipped["optimizer"]["params"]["lr"] = 2e-5
    shipped["train_batch_size"] = 32
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps(shipped))
    data = write_task(tmp_path / "WNLI", "WNLI")
    assert main(["finetune", "--task", "wnli", "--model", str(tiny_export), "--data", str(data), "--out",
                 str(tmp_path / "out"), "--ds-config", str(bad)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --ds-config {bad}: train_batch_size, optimizer.params.lr belong to the command line: pass "
        "--batch-size=32, --lr=2e-05 and remove them here"]


def test_help_and_evaluate_import_nothing_heavy() -> None:
    probe = ("import sys; from pretrain.finetune.glue.command import GLUE; GLUE.parser(); import pretrain.finetune.glue.metric;"
             "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'deepspeed', 'datasets', 'pyarrow')"
             " if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]
