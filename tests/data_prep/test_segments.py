"""The packed segment modes as pure functions, against a re-statement of RoBERTa's rule written here,
and the prediction cap that follows the masking rate."""

from __future__ import annotations

import random

import numpy as np
import pytest

from data_prep.config import max_predictions_for
from data_prep.instances import SpecialIds, mask_instance, packed_instances

SPECIAL = SpecialIds(cls=2, sep=3, mask=4, pad=0, unk=1)
C, S = SPECIAL.cls, SPECIAL.sep


def restated_packing(documents: list[list[list[int]]], seq_len: int, cross_documents: bool) -> list[list[int]]:
    """RoBERTa's FULL-SENTENCES / DOC-SENTENCES (Liu et al. 2019, 4.2) and fairseq's `complete` /
    `complete_doc`, re-stated apart from data_prep/instances.py, block by block rather than token by token:

    1. units: each sentence; a sentence longer than the budget (seq_len - 2) becomes its budget-sized
       pieces, each a unit that stands alone (fairseq gives it a block of its own);
    2. a unit joins the last block when neither stands alone, the block plus one [SEP] if the unit
       starts another document plus the unit fit the budget, and (DOC-SENTENCES) both share a document;
    3. a block is [CLS] units [SEP], with [SEP] between units of different documents.
    """
    budget = seq_len - 2
    units: list[tuple[int, list[int], bool]] = []  # (document, tokens, stands alone)
    for doc, document in enumerate(documents):
        for sentence in document:
            if len(sentence) <= budget:
                units.append((doc, list(sentence), False))
            else:
                units += [(doc, list(sentence[i : i + budget]), True) for i in range(0, len(sentence), budget)]

    def tokens_of(block: list[int]) -> list[int]:
        out: list[int] = []
        for k, j in enumerate(block):
            if k and units[block[k - 1]][0] != units[j][0]:
                out.append(S)
            out += units[j][1]
        return out

    blocks: list[list[int]] = []
    for i, (doc, tokens, alone) in enumerate(units):
        if blocks and not alone and not units[blocks[-1][-1]][2]:
            new_document = units[blocks[-1][-1]][0] != doc
            fits = len(tokens_of(blocks[-1])) + new_document + len(tokens) <= budget
            if fits and (cross_documents or not new_document):
                blocks[-1].append(i)
                continue
        blocks.append([i])
    return [[C, *tokens_of(block), S] for block in blocks]


# Budget 6 (seq_len 8). Ids tell the document: A=1x, B=2x, ..., I=95+.
DOCS = [
    [[10, 11]],  # A: shorter than the budget
    [[20], [21, 22]],  # B: shorter; fits after A with the separator, to the last token
    [[30, 31, 32], [33, 34, 35]],  # C: exactly the budget
    [[40], [41, 42, 43, 44], [45, 46], [47, 48, 49]],  # D: longer than the budget
    [list(range(50, 64))],  # E: one sentence of 14 > 6: pieces 6, 6, 2
    [[70, 71], list(range(72, 79)), [79]],  # F: a 7-token sentence between short ones
    [[80, 81, 82]],  # G: joins F's last sentence across the boundary
    [[90, 91], [92, 93]],  # H: 4 tokens
    [[95, 96]],  # I: 4 + 2 fit the budget, 4 + [SEP] + 2 do not
]
FULL = [
    [10, 11, S, 20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44], [45, 46, 47, 48, 49],
    list(range(50, 56)), list(range(56, 62)), [62, 63], [70, 71], list(range(72, 78)), [78], [79, S, 80, 81, 82],
    [90, 91, 92, 93], [95, 96],
]
DOC = [
    [10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44], [45, 46, 47, 48, 49],
    list(range(50, 56)), list(range(56, 62)), [62, 63], [70, 71], list(range(72, 78)), [78], [79], [80, 81, 82],
    [90, 91, 92, 93], [95, 96],
]


@pytest.mark.parametrize(("cross_documents", "expected"), [(True, FULL), (False, DOC)])
def test_packing_by_hand(cross_documents: bool, expected: list[list[int]]) -> None:
    wrapped = [[C, *content, S] for content in expected]
    assert restated_packing(DOCS, 8, cross_documents) == wrapped  # the re-statement says what is written above
    instances = packed_instances(DOCS, 8, cross_documents, SPECIAL)
    assert [inst.input_ids for inst in instances] == wrapped
    assert all(inst.a_len == len(inst.input_ids) and inst.is_random_next is None for inst in instances)


def random_documents(rng: random.Random, count: int, budget: int) -> list[list[list[int]]]:
    """Documents shorter than, equal to and longer than the budget; one sentence in ~12 is longer than it."""
    docs = []
    for d in range(count):
        shape = d % 4
        if shape == 0:  # exactly the budget, in two sentences
            cut = rng.randint(1, budget - 1)
            lengths = [cut, budget - cut]
        else:
            lengths = [rng.randint(1, budget * 2 if rng.random() < 0.08 else budget // 2)
                       for _ in range(rng.randint(1, 3 if shape == 1 else 15))]
        docs.append([[rng.randrange(10, 1000) for _ in range(n)] for n in lengths])
    return docs


@pytest.mark.parametrize("seq_len", [10, 16, 64, 128])
@pytest.mark.parametrize("cross_documents", [True, False])
def test_packing_equals_the_restated_rule(seq_len: int, cross_documents: bool) -> None:
    budget = seq_len - 2
    docs = random_documents(random.Random(seq_len), 120, budget)
    sizes = [sum(len(s) for s in doc) for doc in docs]
    assert min(sizes) < budget and budget in sizes and max(sizes) > budget
    assert any(len(s) > budget for doc in docs for s in doc)
    expected = restated_packing(docs, seq_len, cross_documents)
    got = [inst.input_ids for inst in packed_instances(docs, seq_len, cross_documents, SPECIAL)]
    assert len(got) == len(expected)
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"instance {index}"
    # Nothing lost, nothing reordered, nothing too long; a [SEP] inside only between documents.
    assert all(len(ids) <= seq_len and ids[0] == C and ids[-1] == S for ids in got)
    inner = [t for ids in got for t in ids[1:-1]]
    assert [t for t in inner if t != S] == [t for doc in docs for sentence in doc for t in sentence]
    separators = inner.count(S)
    assert separators > 0 if cross_documents else separators == 0
    assert separators <= len(docs) - 1
    if not cross_documents:  # an instance never holds two documents
        assert len(got) >= len(docs)


def test_packing_is_lazy_and_deterministic() -> None:
    """Documents come as a generator (the stage streams them from the memory-mapped corpus)."""
    docs = random_documents(random.Random(1), 40, 30)
    once = packed_instances((d for d in docs), 32, True, SPECIAL)
    assert [i.input_ids for i in once] == [i.input_ids for i in packed_instances(docs, 32, True, SPECIAL)]


@pytest.mark.parametrize(
    ("seq_len", "mask_prob", "cap"),
    [(128, 0.15, 20), (512, 0.15, 80), (64, 0.15, 10), (48, 0.15, 8), (128, 0.30, 40), (512, 0.30, 160),
     (64, 0.30, 20), (128, 0.40, 53), (8, 0.01, 1)],
)
def test_prediction_cap_follows_the_rate(seq_len: int, mask_prob: float, cap: int) -> None:
    assert max_predictions_for(seq_len, mask_prob) == cap
    assert max_predictions_for(seq_len) == max_predictions_for(seq_len, 0.15)
    assert cap >= round(seq_len * mask_prob)  # the cap never keeps the rate from being reached


def test_whole_word_masking_at_30_percent_on_packed_instances() -> None:
    continuation = np.zeros(1000, dtype=bool)
    continuation[500:] = True  # ids >= 500 are '##' pieces
    rng = random.Random(5)
    docs = random_documents(random.Random(9), 60, 126)
    masked_total = tokens_total = 0
    for inst in packed_instances(docs, 128, True, SPECIAL):
        ids = inst.input_ids
        out = mask_instance(ids, 0.30, max_predictions_for(128, 0.30), SPECIAL, 1000, rng, continuation)
        chosen = set(out.masked_positions)
        assert len(chosen) <= 40 and not any(ids[p] in (C, S) for p in chosen)
        for pos in chosen:
            if continuation[ids[pos]] and ids[pos - 1] not in (C, S):
                assert pos - 1 in chosen  # a '##' piece is never masked without the piece before it
            if pos + 1 < len(ids) and continuation[ids[pos + 1]]:
                assert pos + 1 in chosen
        masked_total += len(chosen)
        tokens_total += len(ids)
    # Whole words can leave a few slots unfilled (a word that would overflow is skipped): a little under 0.30.
    assert 0.27 < masked_total / tokens_total <= 0.305
