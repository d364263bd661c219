"""Windows, labels and post-processing: answers go in as characters and come back as the same text."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.finetune.squad.data import parse_squad
from pretrain.finetune.squad.features import (
    NO_OFFSET,
    FeatureConfig,
    build_features,
    doc_spans,
    max_context_mask,
)
from pretrain.finetune.squad.postprocess import PostprocessConfig, postprocess
from tests.support import squad_fixtures


@pytest.fixture(scope="module")
def tokenizer():
    return squad_fixtures.build_tokenizer()


@pytest.fixture(scope="module")
def examples():
    return parse_squad({"data": squad_fixtures.squad_articles()}, "fixture").examples


def test_doc_spans_follow_bert_stride() -> None:
    assert doc_spans(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
    assert doc_spans(3, 8, 2) == [(0, 3)]
    assert doc_spans(0, 8, 2) == [(0, 0)]  # an empty context still gets one window
    spans = doc_spans(10, 4, 3)
    owners = []
    for t in range(10):
        holders = [i for i, (s, n) in enumerate(spans) if s <= t < s + n]
        best = [i for i in holders if max_context_mask(spans, i)[t - spans[i][0]]]
        assert len(best) == 1  # every token has exactly one best window
        owners.append(best[0])
    # Token 3 ends span 0 and starts span 1 (no context either side in both): ties go to the first.
    assert owners == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_labels_point_at_the_answer_in_every_window_that_holds_it(tokenizer, examples) -> None:
    config = FeatureConfig(max_seq_length=40, doc_stride=8, max_query_length=12)
    features = build_features(examples, tokenizer, config, with_labels=True)
    assert len(features) > 2 * len(examples)  # short windows: every paragraph is split
    found = set()
    for f in range(len(features)):
        example = examples[features.example_index[f]]
        assert len(features.input_ids[f]) <= config.max_seq_length
        start, end = features.start_positions[f], features.end_positions[f]
        if start == 0:
            assert end == 0
            continue
        offsets = features.offsets[f]
        assert features.token_type_ids[f][start] == 1 and offsets[start, 0] != NO_OFFSET
        text = example.context[offsets[start, 0] : offsets[end, 1]]
        assert text.lower() == example.answers[0].text.lower()
        found.add(features.example_index[f])
    assert found == set(range(len(examples)))  # each answer is inside at least one window


def _one_hot_logits(features, positions):
    starts, ends = [], []
    for f in range(len(features)):
        n = len(features.input_ids[f])
        start, end = np.full(n, -5.0), np.full(n, -5.0)
        s, e = positions[f]
        start[s] += 10.0 + 0.01 * f
        end[e] += 10.0
        starts.append(start)
        ends.append(end)
    return starts, ends


def test_postprocess_recovers_every_answer(tokenizer, examples) -> None:
    config = FeatureConfig(max_seq_length=40, doc_stride=8, max_query_length=12)
    features = build_features(examples, tokenizer, config, with_labels=True)
    positions = list(zip(features.start_positions, features.end_positions, strict=True))
    starts, ends = _one_hot_logits(features, positions)
    result = postprocess(examples, features, starts, ends, PostprocessConfig(n_best=5, max_answer_length=30))
    assert set(result.answers) == {e.qid for e in examples}
    for example in examples:
        assert result.answers[example.qid] == example.answers[0].text
        nbest = result.nbest[example.qid]
        assert 1 <= len(nbest) <= 5 and nbest[0]["text"] == example.answers[0].text
        assert sum(entry["probability"] for entry in nbest) == pytest.approx(1.0)
        assert len({entry["text"] for entry in nbest}) == len(nbest)  # texts are de-duplicated
    # An answer longer than max_answer_length tokens is never proposed.
    short = postprocess(examples, features, starts, ends, PostprocessConfig(n_best=5, max_answer_length=1))
    multi_token = [e for e in examples if len(tokenizer(e.answers[0].text, add_special_tokens=False)["input_ids"]) > 1]
    assert multi_token and all(short.answers[e.qid] != e.answers[0].text for e in multi_token)


def test_postprocess_v2_predicts_no_answer_when_null_wins(tokenizer, examples) -> None:
    config = FeatureConfig(max_seq_length=64, doc_stride=16, max_query_length=12)
    features = build_features(examples, tokenizer, config, with_labels=True)
    starts, ends = _one_hot_logits(features, [(0, 0)] * len(features))  # [CLS] wins everywhere
    result = postprocess(examples, features, starts, ends, PostprocessConfig(version_2=True))
    assert all(answer == "" for answer in result.answers.values())
    assert all(result.null_odds[e.qid] > 0 for e in examples)
    assert all(any(entry["text"] == "" for entry in result.nbest[e.qid]) for e in examples)
