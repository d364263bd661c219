"""The GLUE scorer against scikit-learn and SciPy on the same predictions, metric by metric and task by task."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from pretrain.finetune.glue import metric
from pretrain.finetune.glue.__main__ import main
from tests.finetune.glue.glue_files import TITLES, write_task
from tests.support.launching import REPO_ROOT, child_env

GOLD_FILE = {"MNLI": "dev_matched.tsv"}
LABEL_COLUMN = {"CoLA": 1, "SST-2": 1, "MRPC": 0, "STS-B": 9, "QQP": 5, "MNLI": 15, "QNLI": 3, "RTE": 3, "WNLI": 3}
NAMES = {"MNLI": ["entailment", "neutral", "contradiction"], "QNLI": ["entailment", "not_entailment"],
         "RTE": ["entailment", "not_entailment"]}


def reference(title: str, gold: list, predicted: list) -> dict[str, float]:
    """What scikit-learn / SciPy say, in percent: GLUE's metrics for `title`."""
    if title == "CoLA":
        return {"matthews_correlation": 100 * matthews_corrcoef(gold, predicted)}
    if title == "STS-B":
        return {"pearson": 100 * pearsonr(predicted, gold)[0], "spearman": 100 * spearmanr(predicted, gold)[0]}
    scores = {"accuracy": 100 * accuracy_score(gold, predicted)}
    if title in ("MRPC", "QQP"):
        scores["f1"] = 100 * f1_score(gold, predicted, pos_label="1", zero_division=0.0)
    return scores


@pytest.mark.parametrize("seed", range(5))
def test_each_metric_equals_sklearn_and_scipy(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(5, 300)
    gold = [rng.randint(0, 1) for _ in range(n)]
    predicted = [g if rng.random() < 0.7 else 1 - g for g in gold]
    assert metric.accuracy(gold, predicted) == pytest.approx(accuracy_score(gold, predicted), abs=1e-12)
    assert metric.f1(gold, predicted) == pytest.approx(f1_score(gold, predicted), abs=1e-12)
    assert metric.matthews_correlation(gold, predicted) == pytest.approx(matthews_corrcoef(gold, predicted), abs=1e-12)
    three = [rng.randint(0, 2) for _ in range(n)]
    guess = [rng.randint(0, 2) for _ in range(n)]
    assert metric.matthews_correlation(three, guess) == pytest.approx(matthews_corrcoef(three, guess), abs=1e-12)
    scores = [round(rng.uniform(0, 5), 1) for _ in range(n)]  # rounded: many ties, as in STS-B's gold
    noisy = [round(s + rng.gauss(0, 1), 1) for s in scores]
    assert metric.pearson(noisy, scores) == pytest.approx(pearsonr(noisy, scores)[0], abs=1e-12)
    assert metric.spearman(noisy, scores) == pytest.approx(spearmanr(noisy, scores)[0], abs=1e-12)


def test_the_degenerate_cases_are_scored_as_sklearn_does() -> None:
    one_class = [1, 1, 1, 1]
    assert metric.matthews_correlation(one_class, [1, 0, 1, 0]) == matthews_corrcoef(one_class, [1, 0, 1, 0]) == 0.0
    assert metric.f1([0, 0, 0], [0, 0, 0]) == f1_score([0, 0, 0], [0, 0, 0], zero_division=0.0) == 0.0
    assert metric.f1([1, 0, 1], [0, 0, 0]) == f1_score([1, 0, 1], [0, 0, 0], zero_division=0.0) == 0.0


@pytest.mark.parametrize("title", TITLES)
def test_glue_evaluate_agrees_with_sklearn_and_scipy_on_every_task(title: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_task(tmp_path / title, title, train=2, dev=60, test=1, seed=3)
    gold_path = folder / GOLD_FILE.get(title, "dev.tsv")
    lines = gold_path.read_text(encoding="utf-8").splitlines()
    rows = [line.split("\t") for line in (lines if title == "CoLA" else lines[1:])]
    gold = [row[LABEL_COLUMN[title]].strip() for row in rows]
    rng = random.Random(title)
    if title == "STS-B":
        predicted = [str(round(float(g) + rng.gauss(0, 1.5), 2)) for g in gold]
    else:
        names = NAMES.get(title, ["0", "1"])
        predicted = [g if rng.random() < 0.6 else rng.choice(names) for g in gold]
    # Index: the file's index/id column where the task has one, else the row number.
    indices = [row[0] for row in rows] if title in ("STS-B", "QQP", "MNLI", "QNLI", "RTE", "WNLI") else \
        [str(i) for i in range(len(rows))]
    predictions = tmp_path / "predictions.tsv"
    predictions.write_text("index\tprediction\n" + "".join(f"{i}\t{p}\n" for i, p in zip(indices, predicted, strict=True)))
    assert main(["evaluate", "--task", title, str(gold_path), str(predictions)]) == 0
    scores = json.loads(capsys.readouterr().out)
    if title == "STS-B":
        expected = reference(title, [float(g) for g in gold], [float(p) for p in predicted])
    else:
        expected = reference(title, gold, predicted)
    assert set(scores) == {*expected, "score"}
    for name, value in expected.items():
        assert scores[name] == pytest.approx(value, abs=1e-9), name
    assert scores["score"] == pytest.approx(sum(expected.values()) / len(expected), abs=1e-9)


def test_launch_sh_glue_evaluate_scores_and_refuses(tmp_path: Path) -> None:
    folder = write_task(tmp_path / "RTE", "RTE", train=2, dev=4, test=1)
    predictions = tmp_path / "RTE.tsv"
    predictions.write_text("index\tprediction\n0\tentailment\n1\tnot_entailment\n2\tentailment\n3\tentailment\n")
    command = ["bash", str(REPO_ROOT / "launch.sh"), "glue", "evaluate", "--task", "rte", str(folder / "dev.tsv")]
    good = subprocess.run([*command, str(predictions)], env=child_env(PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=120)
    assert good.returncode == 0, good.stderr[-2000:]
    assert json.loads(good.stdout.splitlines()[-1]) == {"accuracy": 75.0, "score": 75.0}  # fixture labels alternate
    bad = subprocess.run([*command, str(folder / "dev.tsv")], env=child_env(PYTHON=sys.executable),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [f"error: {folder / 'dev.tsv'}: not the GLUE submission format: a header "
                                       "'index<TAB>prediction', then one row per example; line 1 is "
                                       "'index\\tsentence1\\tsentence2\\tlabel'"]
