"""The SQuAD scorer: cases from the official definition, an independent re-computation, real systems."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import pytest

from pretrain.finetune.squad.__main__ import main
from pretrain.finetune.squad.metric import evaluate_v1, evaluate_v2, exact_v1, f1_v1, f1_v2, normalize_answer

# ---------------------------------------------------------------- definition cases (v1.1)
NORMALISATION_CASES = [
    ("The Cat!", "cat"),
    ("U.S.A.", "usa"),
    ("an apple a day", "apple day"),
    ("theater", "theater"),  # articles only as whole words
    ("  New \t  York \n", "new york"),
    ("Café", "café"),  # unicode letters are kept and lower-cased
    ("The élan", "élan"),
    ("naïve—approach", "naïve—approach"),  # the em dash is not ASCII punctuation: it stays
    ("A", ""),
    ("", ""),
    ("rock 'n' roll", "rock n roll"),
]


@pytest.mark.parametrize(("text", "expected"), NORMALISATION_CASES)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


F1_CASES = [
    # prediction, reference, v1.1 F1, v2.0 F1
    ("the big red dog", "red dog", 0.8, 0.8),
    ("dog dog cat", "dog cat cat", 2 / 3, 2 / 3),  # bag of tokens: counts matter
    ("Denver Broncos", "denver broncos.", 1.0, 1.0),
    ("Broncos", "Carolina Panthers", 0.0, 0.0),
    ("", "", 0.0, 1.0),  # v1.1: no overlap = 0; v2.0: both empty = agreement
    ("", "Panthers", 0.0, 0.0),
    ("the", "", 0.0, 1.0),  # "the" normalises to nothing
]


@pytest.mark.parametrize(("prediction", "reference", "f1_one", "f1_two"), F1_CASES)
def test_f1_per_version(prediction: str, reference: str, f1_one: float, f1_two: float) -> None:
    assert f1_v1(prediction, reference) == pytest.approx(f1_one)
    assert f1_v2(reference, prediction) == pytest.approx(f1_two)


def _qa(qid: str, answers: list[str]) -> dict:
    return {"id": qid, "question": "?", "answers": [{"text": a, "answer_start": 0} for a in answers]}


def _dataset(*qas: dict) -> list[dict]:
    return [{"title": "t", "paragraphs": [{"context": "", "qas": list(qas)}]}]


def test_v1_max_over_references_unanswered_and_extra_ids() -> None:
    dataset = _dataset(
        _qa("q1", ["Denver Broncos", "the Broncos", "Broncos"]),
        _qa("q2", ["Santa Clara, California", "Levi's Stadium"]),
        _qa("q3", ["February 7, 2016"]),
    )
    predictions = {"q1": "Broncos!", "q2": "Levi's Stadium in Santa Clara", "not-in-data": "x"}
    report = evaluate_v1(dataset, predictions)
    # q1: exact via the third reference; q2: best F1 over references; q3 unanswered scores 0.
    f1_q2 = max(f1_v1(predictions["q2"], r) for r in ["Santa Clara, California", "Levi's Stadium"])
    assert f1_q2 == pytest.approx(2 * (2 / 5) * 1.0 / (2 / 5 + 1.0))  # the "levis stadium" reference wins
    assert report.scores["exact_match"] == pytest.approx(100 / 3)
    assert report.scores["f1"] == pytest.approx(100 * (1 + f1_q2) / 3)
    assert report.unanswered == ["q3"]


def test_v2_scores_thresholds_and_breakdown() -> None:
    dataset = _dataset(_qa("q1", ["Paris"]), _qa("q2", []), _qa("q3", ["blue whale"]), _qa("q4", []))
    predictions = {"q1": "Paris", "q2": "", "q3": "whale", "q4": "something"}
    plain = evaluate_v2(dataset, predictions).scores
    assert plain == pytest.approx({
        "exact": 50.0, "f1": 100 * (1 + 1 + 2 / 3 + 0) / 4, "total": 4,
        "HasAns_exact": 50.0, "HasAns_f1": 100 * (1 + 2 / 3) / 2, "HasAns_total": 2,
        "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2,
    })
    na_probs = {"q1": 0.1, "q2": 0.9, "q3": 0.3, "q4": 0.8}
    scored = evaluate_v2(dataset, predictions, na_probs, na_prob_threshold=0.5).scores
    # q2 and q4 are above the threshold: predicted unanswerable, which is right for both.
    assert scored["exact"] == pytest.approx(75.0)
    assert scored["f1"] == pytest.approx(100 * (1 + 1 + 2 / 3 + 1) / 4)
    # Sweep in increasing probability: start at 2 (all no-answer right), q1 +1, q3 +0 / +2/3, q4 -1, q2 0.
    assert scored["best_exact"] == pytest.approx(75.0) and scored["best_exact_thresh"] == 0.1
    assert scored["best_f1"] == pytest.approx(100 * (3 + 2 / 3) / 4) and scored["best_f1_thresh"] == 0.3


def test_v2_rejects_na_probs_that_miss_a_question() -> None:
    with pytest.raises(ValueError, match="q2"):
        evaluate_v2(_dataset(_qa("q1", ["x"]), _qa("q2", [])), {"q1": "x", "q2": ""}, {"q1": 0.5})


# ---------------------------------------------------------------- independent re-computation
_ARTICLE = re.compile(r"(?<!\w)(?:a|an|the)(?!\w)")


def _independent_tokens(text: str) -> list[str]:
    kept = text.lower().translate(str.maketrans("", "", string.punctuation))
    return _ARTICLE.sub(" ", kept).split()


def _independent_f1(prediction: list[str], reference: list[str]) -> float:
    remaining = list(reference)
    overlap = 0
    for token in prediction:
        if token in remaining:
            remaining.remove(token)
            overlap += 1
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(prediction), overlap / len(reference)
    return 2 * precision * recall / (precision + recall)


def _independent_v1(dataset: dict, predictions: dict[str, str]) -> tuple[float, float]:
    exact = f1 = 0.0
    count = 0
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                count += 1
                if qa["id"] not in predictions:
                    continue
                prediction = _independent_tokens(predictions[qa["id"]])
                references = [_independent_tokens(answer["text"]) for answer in qa["answers"]]
                exact += any(prediction == reference for reference in references)
                f1 += max(_independent_f1(prediction, reference) for reference in references)
    return 100 * exact / count, 100 * f1 / count


# What the official evaluate-v1.1.py prints for these files on dev-v1.1-subset.json (run once by
# hand; the official script is not part of this repository).
OFFICIAL_V1 = {
    "BERT": (89.75308641975309, 92.47033830367158),
    "SLQA+": (84.93827160493827, 87.24875509175027),
    "r-net+": (83.08641975308642, 85.35077405447775),
    "Match-LSTM_with_Ans-Ptr": (65.80246913580247, 70.57436113324324),
    "Logistic_Regression_Baseline": (35.55555555555556, 44.735121363102195),
}


@pytest.mark.shared_data
def test_real_system_predictions(shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    squad = shared_data / "squad"
    dev_path = squad / "dev-v1.1-subset.json"
    dev = json.loads(dev_path.read_text(encoding="utf-8"))
    f1_by_system = {}
    for system, (official_em, official_f1) in OFFICIAL_V1.items():
        predictions_path = squad / "predictions" / f"{system}.dev-v1.1.predictions.json"
        assert main(["evaluate", str(dev_path), str(predictions_path)]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed == {"exact_match": official_em, "f1": official_f1}  # to the last digit
        independent = _independent_v1(dev, json.loads(predictions_path.read_text(encoding="utf-8")))
        assert (printed["exact_match"], printed["f1"]) == pytest.approx(independent, abs=1e-9)
        f1_by_system[system] = printed["f1"]
    ranking = sorted(f1_by_system, key=f1_by_system.__getitem__, reverse=True)
    assert ranking == ["BERT", "SLQA+", "r-net+", "Match-LSTM_with_Ans-Ptr", "Logistic_Regression_Baseline"]


def test_cli_reports_unanswered_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    context = "Paris is the capital of France."
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [
        {"id": "a", "question": "Capital?", "answers": [{"text": "Paris", "answer_start": 0}]},
        {"id": "b", "question": "Country?", "answers": [{"text": "France", "answer_start": 24}]},
    ]}]}]}
    (tmp_path / "dev.json").write_text(json.dumps(data))
    (tmp_path / "pred.json").write_text(json.dumps({"a": "paris"}))
    assert main(["evaluate", str(tmp_path / "dev.json"), str(tmp_path / "pred.json")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"exact_match": 50.0, "f1": 50.0}
    # The official scripts print one line per unanswered question; we print one line for all of them.
    assert captured.err == f"1 of 2 questions have no prediction in {tmp_path / 'pred.json'} and score 0 (first: 'b')\n"
    assert exact_v1("Paris", "paris.")
