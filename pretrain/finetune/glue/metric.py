"""GLUE's metrics, as GLUE defines them, in the standard library only (no torch, no numpy).

* CoLA: Matthews correlation coefficient (sklearn's ``matthews_corrcoef``: 0 when it is undefined,
  i.e. when gold or predictions hold one class only);
* STS-B: Pearson and Spearman correlation of the predicted and gold scores (Spearman: Pearson of the
  ranks, ties sharing their mean rank, as ``scipy.stats.spearmanr``; NaN when a side is constant, as SciPy);
* MRPC, QQP: F1 of the positive class (label 1: paraphrase / duplicate) and accuracy;
* SST-2, MNLI (matched and mismatched, scored separately), QNLI, RTE, WNLI: accuracy.

Values are in percent, as the GLUE leaderboard prints them; ``score`` is the mean of a task's metrics
(the one number per task the GLUE average is taken over). tests/finetune/glue/test_metric.py checks each
against scikit-learn and SciPy on the same predictions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pretrain.finetune.glue.tasks import Task

Numbers = Sequence[float]


def accuracy(gold: Numbers, predicted: Numbers) -> float:
    return sum(1 for g, p in zip(gold, predicted, strict=True) if g == p) / len(gold)


def confusion(gold: Numbers, predicted: Numbers) -> tuple[int, int, int, int]:
    """(true positives, false positives, false negatives, true negatives) with 1 the positive class."""
    tp = fp = fn = tn = 0
    for g, p in zip(gold, predicted, strict=True):
        if p == 1:
            tp, fp = tp + (g == 1), fp + (g != 1)
        else:
            fn, tn = fn + (g == 1), tn + (g != 1)
    return tp, fp, fn, tn


def f1(gold: Numbers, predicted: Numbers) -> float:
    """Binary F1 of label 1 (sklearn ``f1_score``: 0 when there are no positives on either side)."""
    tp, fp, fn, _ = confusion(gold, predicted)
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews_correlation(gold: Numbers, predicted: Numbers) -> float:
    """Matthews correlation in its multi-class form (Gorodkin), which is the usual one for two classes."""
    classes = sorted(set(gold) | set(predicted))
    true_count = {c: 0 for c in classes}
    predicted_count = {c: 0 for c in classes}
    correct = 0
    for g, p in zip(gold, predicted, strict=True):
        true_count[g] += 1
        predicted_count[p] += 1
        correct += g == p
    samples = len(gold)
    covariance = correct * samples - sum(true_count[c] * predicted_count[c] for c in classes)
    spread_pred = samples * samples - sum(v * v for v in predicted_count.values())
    spread_true = samples * samples - sum(v * v for v in true_count.values())
    if spread_pred == 0 or spread_true == 0:
        return 0.0
    return covariance / math.sqrt(spread_true * spread_pred)


def pearson(x: Numbers, y: Numbers) -> float:
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"Pearson needs two sequences of the same length >= 2, got {len(x)} and {len(y)}")
    mean_x, mean_y = math.fsum(x) / len(x), math.fsum(y) / len(y)
    dx = [v - mean_x for v in x]
    dy = [v - mean_y for v in y]
    denominator = math.sqrt(math.fsum(v * v for v in dx)) * math.sqrt(math.fsum(v * v for v in dy))
    if denominator == 0:
        return math.nan  # a constant side: undefined, as SciPy says
    return max(-1.0, min(1.0, math.fsum(a * b for a, b in zip(dx, dy, strict=True)) / denominator))


def ranks(values: Numbers) -> list[float]:
    """1-based ranks, tied values sharing the mean of their ranks (scipy.stats.rankdata 'average')."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(x: Numbers, y: Numbers) -> float:
    return pearson(ranks(x), ranks(y))


METRICS = {"accuracy": accuracy, "f1": f1, "matthews_correlation": matthews_correlation,
           "pearson": pearson, "spearman": spearman}


def score(task: Task, gold: Numbers, predicted: Numbers) -> dict[str, float]:
    """The task's GLUE metrics in percent, and their mean as ``score``."""
    if len(gold) != len(predicted) or not gold:
        raise ValueError(f"{task.title}: {len(gold)} gold values and {len(predicted)} predictions")
    scores = {name: 100.0 * METRICS[name](gold, predicted) for name in task.metrics}
    scores["score"] = math.fsum(scores.values()) / len(task.metrics)
    return scores
