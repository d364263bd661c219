"""`squad evaluate` on the wrong predictions file: one short line naming it, exit 2 (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import squad_fixtures
from tests.support.launching import REPO_ROOT, child_env

SHORT = 300  # characters: an error line names the file and what was expected, it never quotes a file


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 30 copies of the fixture article: a dataset big enough that quoting it would show.
    return squad_fixtures.write_squad(tmp_path_factory.mktemp("evaluate") / "dev.json", repeat=30)


def _question_ids(dataset: Path) -> list[str]:
    data = json.loads(dataset.read_text(encoding="utf-8"))["data"]
    return [qa["id"] for article in data for paragraph in article["paragraphs"] for qa in paragraph["qas"]]


def _evaluate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The command exactly as launch.sh runs it: `$PYTHON -m pretrain.finetune.squad evaluate ...`."""
    return subprocess.run([sys.executable, "-m", "pretrain.finetune.squad", "evaluate", *map(str, args)], cwd=REPO_ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def _one_short_error(proc: subprocess.CompletedProcess[str], names: Path, *paths: Path) -> str:
    """The single stderr line of a refusal that names `names`; short once the file names are taken out."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[:2000])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {names}: ") and proc.stdout == "", proc.stderr[:2000]
    rest = lines[0]
    for path in (names, *paths):
        rest = rest.replace(str(path), "")
    assert len(rest) < SHORT, lines[0]
    return lines[0]


def test_predictions_for_another_dataset_are_refused(dev: Path, tmp_path: Path) -> None:
    # Before: exit 0, EM/F1 0 and one "Unanswered question" line per question of the dataset.
    other = _write(tmp_path / "other.json", {f"train-{i}": "an answer" for i in range(500)})
    line = _one_short_error(_evaluate(dev, other), other, dev)
    assert f"none of its 500 question ids is in {dev}" in line and "'train-0'" in line
    empty = _write(tmp_path / "empty.json", {})
    assert "no predictions" in _one_short_error(_evaluate(dev, empty), empty, dev)


def test_the_dataset_in_the_predictions_place_is_named_as_such(dev: Path) -> None:
    # Before: one error line quoting the whole 'data' list (247 KB for the real dev subset).
    line = _one_short_error(_evaluate(dev, dev), dev)
    assert "this is a SQuAD dataset" in line and "give the dataset first, the predictions second" in line


@pytest.mark.parametrize(("content", "expected"), [
    ([{"id": "q0-0-0", "text": "x"}], "expected predictions, a JSON object {question id: answer text}; "
                                      "got a JSON array"),
    ({"q0-0-0": ["word " * 5000]}, "question id 'q0-0-0': the prediction must be a string "
                                   "(a JSON object {question id: answer text}), got array ['word word"),
    ({"q0-0-0": "fine", "q0-0-1": {"text": "long " * 5000}}, "question id 'q0-0-1': the prediction must be a "
                                                             "string (a JSON object {question id: answer text}), "
                                                             "got object {'text': 'long long"),
])
def test_predictions_that_are_not_an_id_to_text_object(dev: Path, tmp_path: Path, content: object,
                                                       expected: str) -> None:
    predictions = _write(tmp_path / "predictions.json", content)
    line = _one_short_error(_evaluate(dev, predictions), predictions)
    assert expected in line
    if isinstance(content, dict):  # the 25,000-character value is quoted cut, with its length
        assert line.endswith(" characters)")


def test_partly_answered_scores_the_missing_zero_in_one_summary_line(dev: Path, tmp_path: Path) -> None:
    ids = _question_ids(dev)
    answers = {qa["id"]: qa["answers"][0]["text"] for article in json.loads(dev.read_text())["data"]
               for paragraph in article["paragraphs"] for qa in paragraph["qas"]}
    half = _write(tmp_path / "half.json", {qid: answers[qid] for qid in ids[: len(ids) // 2]})
    proc = _evaluate(dev, half)
    assert proc.returncode == 0, proc.stderr[:2000]
    assert json.loads(proc.stdout) == {"exact_match": 50.0, "f1": 50.0}  # the missing half scores 0
    assert proc.stderr.splitlines() == [
        f"{len(ids) - len(ids) // 2:,} of {len(ids):,} questions have no prediction in {half} and score 0 "
        f"(first: {ids[len(ids) // 2]!r})"
    ]
    two = subprocess.run([sys.executable, "-m", "pretrain.finetune.squad", "evaluate", str(dev), str(half), "--version", "2"],
                         cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert two.returncode == 0 and json.loads(two.stdout)["exact"] == 50.0
    assert len(two.stderr.splitlines()) == 1 and "questions have no prediction" in two.stderr


def test_launch_sh_passes_the_refusal_on(dev: Path, tmp_path: Path) -> None:
    other = _write(tmp_path / "other.json", {"not-a-question": "x"})
    proc = subprocess.run(["bash", str(REPO_ROOT / "launch.sh"), "squad", "evaluate", str(dev), str(other)],
                          env=child_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[:2000]
    assert proc.stderr.splitlines() == [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(proc.stderr.splitlines()) == 1 and f"error: {other}: none of its 1 question ids" in proc.stderr
