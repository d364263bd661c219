"""Start/end logits of every window → answer text per question, n-best lists and no-answer odds.

numpy only. For each question, over all of its windows: the ``n_best`` highest start logits and
the ``n_best`` highest end logits are paired; a pair is kept when both tokens are context tokens,
end >= start, the answer spans at most ``max_answer_length`` tokens and the start token has its
maximum context in this window. Candidates are ranked by start + end logit; the answer text is
the context slice between the two tokens' character offsets. For SQuAD v2.0 the null answer's
score is the smallest [CLS] start + end over the windows, and the question is predicted
unanswerable when ``null - best > null_score_diff_threshold`` (that difference is the "odds"
value written for the official scorer's ``--na-prob``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretrain.finetune.squad.data import Example
from pretrain.finetune.squad.features import NO_OFFSET, Features


@dataclass(frozen=True)
class PostprocessConfig:
    n_best: int = 20
    max_answer_length: int = 30
    version_2: bool = False
    null_score_diff_threshold: float = 0.0


@dataclass
class Predictions:
    answers: dict[str, str]  # predictions.json
    nbest: dict[str, list[dict[str, float | str]]]  # nbest_predictions.json
    null_odds: dict[str, float]  # null_odds.json (v2.0 only; empty for v1.1)


def _top_indices(logits: np.ndarray, n: int) -> np.ndarray:
    # Stable sort on the negated logits: equal logits keep token order, run after run.
    return np.argsort(-logits, kind="stable")[:n]


def _softmax(scores: np.ndarray) -> np.ndarray:
    if len(scores) == 0:
        return scores
    exp = np.exp(scores - scores.max())
    return exp / exp.sum()


def _window_candidates(
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    offsets: np.ndarray,
    max_context: np.ndarray,
    config: PostprocessConfig,
) -> list[tuple[float, float, float, int, int]]:
    """(score, start_logit, end_logit, char_start, char_end) for every admissible pair."""
    candidates = []
    for s in _top_indices(start_logits, config.n_best):
        if offsets[s, 0] == NO_OFFSET or not max_context[s]:
            continue
        for e in _top_indices(end_logits, config.n_best):
            if offsets[e, 0] == NO_OFFSET or e < s or e - s + 1 > config.max_answer_length:
                continue
            score = float(start_logits[s]) + float(end_logits[e])
            candidates.append((score, float(start_logits[s]), float(end_logits[e]), int(offsets[s, 0]), int(offsets[e, 1])))
    return candidates


def postprocess(
    examples: Sequence[Example],
    features: Features,
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    config: PostprocessConfig,
) -> Predictions:
    """Logits are per window, in the order of ``features``, each as long as that window's tokens."""
    if len(start_logits) != len(features) or len(end_logits) != len(features):
        raise ValueError(
            f"{len(features)} windows but {len(start_logits)} start and {len(end_logits)} end logit rows"
        )
    windows_of: list[list[int]] = [[] for _ in examples]
    for feature_index, example_index in enumerate(features.example_index):
        windows_of[example_index].append(feature_index)

    result = Predictions({}, {}, {})
    for example_index, example in enumerate(examples):
        candidates: list[tuple[float, float, float, int, int]] = []
        null = None  # (score, start_logit, end_logit) of the best-scoring window's [CLS] pair
        for f in windows_of[example_index]:
            starts = np.asarray(start_logits[f], dtype=np.float64)
            ends = np.asarray(end_logits[f], dtype=np.float64)
            n = len(features.input_ids[f])
            if len(starts) < n or len(ends) < n:
                raise ValueError(f"window {f} of question {example.qid!r} has {n} tokens but shorter logits")
            starts, ends = starts[:n], ends[:n]
            if null is None or starts[0] + ends[0] < null[0]:
                null = (float(starts[0] + ends[0]), float(starts[0]), float(ends[0]))
            candidates += _window_candidates(starts, ends, features.offsets[f], features.max_context[f], config)
        candidates.sort(key=lambda c: c[0], reverse=True)

        entries: list[dict[str, float | str]] = []
        seen_texts: set[str] = set()
        for score, start_logit, end_logit, char_start, char_end in candidates:
            text = example.context[char_start:char_end]
            if text in seen_texts:  # the same text from another window or token pair
                continue
            seen_texts.add(text)
            entries.append({"text": text, "start_logit": start_logit, "end_logit": end_logit, "score": score})
            if len(entries) == config.n_best:
                break
        best_non_null = entries[0] if entries else None
        if config.version_2 and null is not None and "" not in seen_texts:
            entries.append({"text": "", "start_logit": null[1], "end_logit": null[2], "score": null[0]})
            entries.sort(key=lambda entry: entry["score"], reverse=True)
        if not entries:
            entries.append({"text": "", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})
        probabilities = _softmax(np.asarray([entry["score"] for entry in entries], dtype=np.float64))
        result.nbest[example.qid] = [
            {"text": entry["text"], "probability": float(p), "start_logit": entry["start_logit"], "end_logit": entry["end_logit"]}
            for entry, p in zip(entries, probabilities, strict=True)
        ]

        best_text = str(best_non_null["text"]) if best_non_null else ""
        if not config.version_2:
            result.answers[example.qid] = best_text
            continue
        best_score = float(best_non_null["score"]) if best_non_null else float("-inf")
        null_score = null[0] if null is not None else 0.0
        diff = null_score - best_score
        result.null_odds[example.qid] = diff if np.isfinite(diff) else 1e9
        result.answers[example.qid] = "" if diff > config.null_score_diff_threshold else best_text
    return result
