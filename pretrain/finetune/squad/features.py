"""SQuAD examples → BERT input windows, with character offsets from the fast tokenizer.

Windowing follows the original BERT ``run_squad.py``: the question (at most 64 tokens) and a
window of the context fill ``[CLS] question [SEP] context-window [SEP]`` up to 384 tokens; the
next window starts ``doc_stride`` = 128 tokens later (so windows overlap a lot), and each token
remembers whether this window is the one that gives it the most context on both sides, so
post-processing only starts answers where the token is best placed. Character offsets come from
the fast tokenizer (no whitespace re-alignment heuristics): an answer is ``context[a:b]``.

No torch here: features are numpy arrays, padded per batch by the training code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pretrain.finetune.squad.data import Example

NO_OFFSET = -1  # offsets of [CLS], question, [SEP] and padding tokens


@dataclass(frozen=True)
class FeatureConfig:
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64

    def __post_init__(self) -> None:
        if self.max_query_length < 1 or self.doc_stride < 1:
            raise ValueError(f"max_query_length and doc_stride must be >= 1, got {self}")
        if self.max_seq_length < self.max_query_length + 4:
            raise ValueError(
                f"max_seq_length {self.max_seq_length} leaves no room for the context after a "
                f"{self.max_query_length}-token question and 3 special tokens"
            )


@dataclass
class Features:
    """One row per window. Token arrays are unpadded (their lengths differ)."""

    input_ids: list[np.ndarray] = field(default_factory=list)  # int64 [n]
    token_type_ids: list[np.ndarray] = field(default_factory=list)  # int64 [n]
    offsets: list[np.ndarray] = field(default_factory=list)  # int64 [n, 2]; NO_OFFSET outside the context
    max_context: list[np.ndarray] = field(default_factory=list)  # bool [n]
    example_index: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)  # 0 ([CLS]) when the answer is not inside
    end_positions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def doc_spans(num_doc_tokens: int, max_tokens_for_doc: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) windows over the context tokens, as BERT's run_squad.py builds them."""
    spans: list[tuple[int, int]] = []
    start = 0
    while True:
        length = min(num_doc_tokens - start, max_tokens_for_doc)
        spans.append((start, length))
        if start + length >= num_doc_tokens:
            return spans
        start += min(length, doc_stride)


def max_context_mask(spans: list[tuple[int, int]], span_index: int) -> np.ndarray:
    """For each token of span ``span_index``: is this the span where it has the most context?

    Score of a token in a span = min(tokens left of it, tokens right of it) + 0.01 * span length;
    ties go to the earliest span (BERT's ``_check_is_max_context``).
    """
    start, length = spans[span_index]
    positions = np.arange(start, start + length)
    best = np.full(length, -1.0)
    best_span = np.full(length, -1)
    for index, (other_start, other_length) in enumerate(spans):
        inside = (positions >= other_start) & (positions < other_start + other_length)
        left = positions - other_start
        right = other_start + other_length - 1 - positions
        score = np.minimum(left, right) + 0.01 * other_length
        better = inside & (score > best)
        best = np.where(better, score, best)
        best_span = np.where(better, index, best_span)
    return best_span == span_index


def _answer_token_span(offsets: np.ndarray, char_start: int, char_end: int) -> tuple[int, int] | None:
    """First and last context token covering ``[char_start, char_end)``, or None."""
    if len(offsets) == 0:
        return None
    first = int(np.searchsorted(offsets[:, 1], char_start, side="right"))  # first token ending after start
    last = int(np.searchsorted(offsets[:, 0], char_end, side="left")) - 1  # last token starting before end
    if first >= len(offsets) or last < first:
        return None
    return first, last


def build_features(
    examples: Sequence[Example], tokenizer: object, config: FeatureConfig, with_labels: bool
) -> Features:
    """Tokenise every example into windows; ``with_labels`` adds start/end token positions (training).

    ``tokenizer`` is a transformers *fast* tokenizer (offsets come from its Rust backend).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"a fast tokenizer is required for character offsets, got {type(tokenizer).__name__}")
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id  # type: ignore[attr-defined]
    # Many questions share one paragraph: tokenise every distinct context once.
    context_index: dict[str, int] = {}
    for example in examples:
        context_index.setdefault(example.context, len(context_index))
    contexts = list(context_index)
    encoded_contexts = tokenizer(contexts, add_special_tokens=False, return_offsets_mapping=True)  # type: ignore[operator]
    encoded_questions = tokenizer([e.question for e in examples], add_special_tokens=False)  # type: ignore[operator]

    features = Features()
    for example_index, example in enumerate(examples):
        c = context_index[example.context]
        doc_ids = np.asarray(encoded_contexts["input_ids"][c], dtype=np.int64)
        doc_offsets = np.asarray(encoded_contexts["offset_mapping"][c], dtype=np.int64).reshape(-1, 2)
        query_ids = np.asarray(encoded_questions["input_ids"][example_index][: config.max_query_length], dtype=np.int64)
        prefix = np.concatenate([[cls_id], query_ids, [sep_id]]).astype(np.int64)
        answer_tokens = None
        if with_labels and example.answers:
            answer = example.answers[0]
            answer_tokens = _answer_token_span(doc_offsets, answer.start, answer.start + len(answer.text))
        spans = doc_spans(len(doc_ids), config.max_seq_length - len(prefix) - 1, config.doc_stride)
        for span_index, (start, length) in enumerate(spans):
            window = slice(start, start + length)
            input_ids = np.concatenate([prefix, doc_ids[window], [sep_id]]).astype(np.int64)
            token_type_ids = np.zeros(len(input_ids), dtype=np.int64)
            token_type_ids[len(prefix) :] = 1
            offsets = np.full((len(input_ids), 2), NO_OFFSET, dtype=np.int64)
            offsets[len(prefix) : len(prefix) + length] = doc_offsets[window]
            max_context = np.zeros(len(input_ids), dtype=bool)
            max_context[len(prefix) : len(prefix) + length] = max_context_mask(spans, span_index)
            start_position = end_position = 0
            if answer_tokens is not None and start <= answer_tokens[0] and answer_tokens[1] < start + length:
                start_position = len(prefix) + answer_tokens[0] - start
                end_position = len(prefix) + answer_tokens[1] - start
            features.input_ids.append(input_ids)
            features.token_type_ids.append(token_type_ids)
            features.offsets.append(offsets)
            features.max_context.append(max_context)
            features.example_index.append(example_index)
            features.start_positions.append(start_position)
            features.end_positions.append(end_position)
    return features


def pad_batch(features: Features, indices: Sequence[int], pad_id: int, multiple_of: int = 8) -> dict[str, np.ndarray]:
    """Pad the chosen windows to the longest one (rounded up to ``multiple_of`` for tensor cores)."""
    longest = max(len(features.input_ids[i]) for i in indices)
    width = -(-longest // multiple_of) * multiple_of
    batch = {
        "input_ids": np.full((len(indices), width), pad_id, dtype=np.int64),
        "token_type_ids": np.zeros((len(indices), width), dtype=np.int64),
        "attention_mask": np.zeros((len(indices), width), dtype=np.int64),
    }
    for row, i in enumerate(indices):
        n = len(features.input_ids[i])
        batch["input_ids"][row, :n] = features.input_ids[i]
        batch["token_type_ids"][row, :n] = features.token_type_ids[i]
        batch["attention_mask"][row, :n] = 1
    batch["start_positions"] = np.asarray([features.start_positions[i] for i in indices], dtype=np.int64)
    batch["end_positions"] = np.asarray([features.end_positions[i] for i in indices], dtype=np.int64)
    return batch
