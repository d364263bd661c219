"""SQuAD EM/F1 with the exact semantics of the official v1.1 and v2.0 evaluation scripts.

No torch here (and nothing but the standard library): the scorer must be usable on a laptop
with only the predictions file, and it must give the official number to the last digit.
That is why the arithmetic below follows the official scripts' order of operations
(v1.1: a running float sum over the dataset in file order; v2.0: ``sum(dict.values())`` over a
dict filled in file order) and why v1.1 and v2.0 keep their own token/F1 rules:

* v1.1 ``f1_score``: an empty prediction or empty reference scores 0 (no overlap);
* v2.0 ``compute_f1``: when either side has no tokens, F1 is 1 if both are empty, else 0,
  and reference answers that normalise to "" are dropped (only unanswerable questions end up
  with the single reference "").

Where an official script is undefined (v2.0 raises ``KeyError`` when a question has no
prediction), this module scores the question 0 and counts it, as v1.1 does, and reports it.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_tokens(text: str) -> list[str]:
    """v2.0 ``get_tokens``: the normalised answer's whitespace tokens ([] for an empty string)."""
    if not text:
        return []
    return normalize_answer(text).split()


def _overlap_f1(prediction_tokens: list[str], reference_tokens: list[str]) -> float:
    common = collections.Counter(prediction_tokens) & collections.Counter(reference_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(reference_tokens)
    return (2 * precision * recall) / (precision + recall)


def f1_v1(prediction: str, reference: str) -> float:
    """v1.1 ``f1_score``: bag-of-tokens F1 of the normalised strings."""
    return _overlap_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def exact_v1(prediction: str, reference: str) -> bool:
    """v1.1 ``exact_match_score``."""
    return normalize_answer(prediction) == normalize_answer(reference)


def f1_v2(reference: str, prediction: str) -> float:
    """v2.0 ``compute_f1(a_gold, a_pred)``: as v1.1, except that empty vs empty scores 1."""
    reference_tokens = answer_tokens(reference)
    prediction_tokens = answer_tokens(prediction)
    if len(reference_tokens) == 0 or len(prediction_tokens) == 0:
        return int(reference_tokens == prediction_tokens)
    return _overlap_f1(prediction_tokens, reference_tokens)


def exact_v2(reference: str, prediction: str) -> int:
    """v2.0 ``compute_exact(a_gold, a_pred)``."""
    return int(normalize_answer(reference) == normalize_answer(prediction))


def _max_over_references(
    metric: Callable[[str, str], float], prediction: str, references: Iterable[str]
) -> float:
    return max(metric(prediction, reference) for reference in references)


@dataclass
class ScoreReport:
    """The official output dict plus the ids this run could not score."""

    scores: dict[str, float | int]
    unanswered: list[str] = field(default_factory=list)
    questions: int = 0  # in the dataset, answered or not


def iter_questions(dataset: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every ``qa`` dict of an official-layout ``data`` list, in file order."""
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


def evaluate_v1(dataset: list[dict[str, Any]], predictions: Mapping[str, str]) -> ScoreReport:
    """Official v1.1 ``evaluate``: ``{"exact_match", "f1"}`` in percent over every question."""
    f1 = exact_match = total = 0
    unanswered: list[str] = []
    for qa in iter_questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            unanswered.append(qa["id"])
            continue
        references = [answer["text"] for answer in qa["answers"]]
        prediction = predictions[qa["id"]]
        exact_match += _max_over_references(exact_v1, prediction, references)
        f1 += _max_over_references(f1_v1, prediction, references)
    exact_match = 100.0 * exact_match / total
    f1 = 100.0 * f1 / total
    return ScoreReport({"exact_match": exact_match, "f1": f1}, unanswered, total)


def _v2_references(qa: Mapping[str, Any]) -> list[str]:
    references = [answer["text"] for answer in qa["answers"] if normalize_answer(answer["text"])]
    # Unanswerable questions (and answers that normalise to nothing): the only right answer is "".
    return references or [""]


def _v2_eval_dict(
    exact: Mapping[str, float], f1: Mapping[str, float], qids: list[str] | None = None
) -> dict[str, float | int]:
    if not qids:
        total = len(exact)
        return {
            "exact": 100.0 * sum(exact.values()) / total,
            "f1": 100.0 * sum(f1.values()) / total,
            "total": total,
        }
    total = len(qids)
    return {
        "exact": 100.0 * sum(exact[k] for k in qids) / total,
        "f1": 100.0 * sum(f1[k] for k in qids) / total,
        "total": total,
    }


def _apply_no_answer_threshold(
    scores: Mapping[str, float], na_probs: Mapping[str, float], has_answer: Mapping[str, bool], threshold: float
) -> dict[str, float]:
    thresholded = {}
    for qid, score in scores.items():
        predicted_no_answer = na_probs[qid] > threshold
        thresholded[qid] = float(not has_answer[qid]) if predicted_no_answer else score
    return thresholded


def _best_threshold(
    predictions: Mapping[str, str],
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    has_answer: Mapping[str, bool],
) -> tuple[float, float]:
    """v2.0 ``find_best_thresh``: sweep the no-answer probability in increasing order."""
    current = best = sum(1 for qid in has_answer if not has_answer[qid])
    best_threshold = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            diff = scores[qid]
        else:
            diff = -1 if predictions[qid] else 0
        current += diff
        if current > best:
            best = current
            best_threshold = na_probs[qid]
    return 100.0 * best / len(scores), best_threshold


def evaluate_v2(
    dataset: list[dict[str, Any]],
    predictions: Mapping[str, str],
    na_probs: Mapping[str, float] | None = None,
    na_prob_threshold: float = 1.0,
) -> ScoreReport:
    """Official v2.0 evaluation: exact/f1/total, HasAns_*/NoAns_*, and best_* when na_probs is given.

    A missing prediction scores 0 (the official script crashes there) and its id is reported.
    """
    has_answer = {qa["id"]: bool(qa["answers"]) for qa in iter_questions(dataset)}
    exact_raw: dict[str, float] = {}
    f1_raw: dict[str, float] = {}
    unanswered: list[str] = []
    for qa in iter_questions(dataset):
        qid = qa["id"]
        if qid not in predictions:
            unanswered.append(qid)
            exact_raw[qid] = f1_raw[qid] = 0
            continue
        references = _v2_references(qa)
        exact_raw[qid] = max(exact_v2(reference, predictions[qid]) for reference in references)
        f1_raw[qid] = max(f1_v2(reference, predictions[qid]) for reference in references)
    # The official default: every answered question gets no-answer probability 0.
    probs = dict(na_probs) if na_probs is not None else {qid: 0.0 for qid in predictions}
    for qid in unanswered:
        probs.setdefault(qid, 0.0)
    uncovered = [qid for qid in exact_raw if qid not in probs]
    if uncovered:
        raise ValueError(
            f"the no-answer probabilities lack {len(uncovered)} scored question id(s), e.g. {uncovered[0]!r}"
        )
    scored_predictions = {**{qid: "" for qid in unanswered}, **predictions}
    exact_thresholded = _apply_no_answer_threshold(exact_raw, probs, has_answer, na_prob_threshold)
    f1_thresholded = _apply_no_answer_threshold(f1_raw, probs, has_answer, na_prob_threshold)
    result = _v2_eval_dict(exact_thresholded, f1_thresholded)
    for prefix, wanted in (("HasAns", True), ("NoAns", False)):
        qids = [qid for qid, value in has_answer.items() if value is wanted]
        if qids:
            for key, value in _v2_eval_dict(exact_thresholded, f1_thresholded, qids).items():
                result[f"{prefix}_{key}"] = value
    if na_probs is not None:
        best_exact, exact_threshold = _best_threshold(scored_predictions, exact_raw, probs, has_answer)
        best_f1, f1_threshold = _best_threshold(scored_predictions, f1_raw, probs, has_answer)
        result.update(
            best_exact=best_exact,
            best_exact_thresh=exact_threshold,
            best_f1=best_f1,
            best_f1_thresh=f1_threshold,
        )
    return ScoreReport(result, unanswered, len(exact_raw))
