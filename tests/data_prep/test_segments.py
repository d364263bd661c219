"""The packed segment modes as pure functions, against a re-statement of RoBERTa's rule written here,
and the prediction cap that follows the masking rate."""

from __future__ import annotations

import random

import numpy as np
import pytest

from data_prep.config import max_predictions_for
from data_prep.instances import packed_instances
from data_prep.shard_format.masking import SpecialIds, mask_instance

SPECIAL = SpecialIds(cls=2, sep=3, mask=4, pad=0, unk=1)
C, S = SPECIAL.cls, SPECIAL.sep


def restated_pieces(sentence: list[int], seq_len: int, continuation: np.ndarray | None) -> list[list[int]]:
    """A sentence cut into pieces of at most the budget: each cut at the last word start (a token that is
    not a '##' piece) that leaves the piece at least a quarter of seq_len, else at the budget."""
    budget = seq_len - 2
    starts = [i for i, token in enumerate(sentence) if continuation is None or not continuation[token]]
    pieces, begin = [], 0
    while len(sentence) - begin > budget:
        cut = max((i for i in starts if 4 * (i - begin) >= seq_len and i - begin <= budget), default=begin + budget)
        pieces.append(sentence[begin:cut])
        begin = cut
    return [*pieces, sentence[begin:]]


def restated_packing(documents: list[list[list[int]]], seq_len: int, cross_documents: bool,
                     continuation: np.ndarray | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """RoBERTa's FULL-SENTENCES / DOC-SENTENCES (Liu et al. 2019, 4.2) and fairseq's `complete` /
    `complete_doc`, re-stated apart from data_prep/instances.py, block by block rather than token by token;
    returns (the instances, the pieces dropped):

    1. units: each sentence; a sentence longer than the budget (seq_len - 2) becomes its pieces
       (`restated_pieces`): all but the last are units that stand alone; the last is an ordinary unit,
       "short" when under a quarter of seq_len;
    2. a unit joins the last block when neither stands alone, the block plus one [SEP] if the unit
       starts another document plus the unit fit the budget, and (DOC-SENTENCES) both share a document;
    3. a block of one short unit alone is dropped; any other is [CLS] units [SEP], with [SEP] between
       units of different documents.
    """
    budget = seq_len - 2
    units: list[tuple[int, list[int], bool, bool]] = []  # (document, tokens, stands alone, short last piece)
    for doc, document in enumerate(documents):
        for sentence in document:
            *whole, rest = restated_pieces(list(sentence), seq_len, continuation)
            units += [(doc, piece, True, False) for piece in whole]
            units.append((doc, rest, False, bool(whole) and 4 * len(rest) < seq_len))

    def tokens_of(block: list[int]) -> list[int]:
        out: list[int] = []
        for k, j in enumerate(block):
            if k and units[block[k - 1]][0] != units[j][0]:
                out.append(S)
            out += units[j][1]
        return out

    blocks: list[list[int]] = []
    for i, (doc, tokens, alone, _) in enumerate(units):
        if blocks and not alone and not units[blocks[-1][-1]][2]:
            new_document = units[blocks[-1][-1]][0] != doc
            fits = len(tokens_of(blocks[-1])) + new_document + len(tokens) <= budget
            if fits and (cross_documents or not new_document):
                blocks[-1].append(i)
                continue
        blocks.append([i])
    dropped = [block for block in blocks if len(block) == 1 and units[block[0]][3]]
    kept = [[C, *tokens_of(block), S] for block in blocks if block not in dropped]
    return kept, [units[block[0]][1] for block in dropped]


# Budget 6 (seq_len 8; a piece under 2 tokens is short). Ids tell the document: A=1x, B=2x, ..., I=95+.
DOCS = [
    [[10, 11]],  # A: shorter than the budget
    [[20], [21, 22]],  # B: shorter; fits after A with the separator, to the last token
    [[30, 31, 32], [33, 34, 35]],  # C: exactly the budget
    [[40], [41, 42, 43, 44], [45, 46], [47, 48, 49]],  # D: longer than the budget
    [list(range(50, 64))],  # E: one sentence of 14 > 6: pieces 6, 6, and the rest, 2, packed like a sentence
    [[70, 71], list(range(72, 79)), [79]],  # F: a 7-token sentence: a piece of 6, its short rest joins [79]
    [[80, 81, 82]],  # G: joins F's last sentence across the boundary
    [[90, 91], [92, 93]],  # H: 4 tokens
    [[95, 96]],  # I: 4 + 2 fit the budget, 4 + [SEP] + 2 do not
]
FULL = [
    [10, 11, S, 20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44], [45, 46, 47, 48, 49],
    list(range(50, 56)), list(range(56, 62)), [62, 63, S, 70, 71], list(range(72, 78)), [78, 79, S, 80, 81, 82],
    [90, 91, 92, 93], [95, 96],
]
DOC = [
    [10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44], [45, 46, 47, 48, 49],
    list(range(50, 56)), list(range(56, 62)), [62, 63], [70, 71], list(range(72, 78)), [78, 79], [80, 81, 82],
    [90, 91, 92, 93], [95, 96],
]


@pytest.mark.parametrize(("cross_documents", "expected"), [(True, FULL), (False, DOC)])
def test_packing_by_hand(cross_documents: bool, expected: list[list[int]]) -> None:
    wrapped = [[C, *content, S] for content in expected]
    assert restated_packing(DOCS, 8, cross_documents) == (wrapped, [])  # the re-statement says what is above
    packed = packed_instances(DOCS, 8, cross_documents, SPECIAL)
    assert [inst.input_ids for inst in packed.instances] == wrapped
    assert all(inst.a_len == len(inst.input_ids) and inst.is_random_next is None for inst in packed.instances)
    assert (packed.dropped_pieces, packed.dropped_tokens) == (0, 0)


# Budget 10 (seq_len 12; a piece under 3 tokens is short). Word starts are 100..499, '##' pieces 500 and up.
WORDED = np.arange(1000) >= 500
LONG = [101, 501, 502, 102, 103, 503, 104, 105, 504, 505, 506, 106, 107, 108, 507, 109, 110, 508, 509, 111, 112,
        113, 510, 114, 115]  # 2.5 x the budget; a cut at 10 or at 20 would split a word
WORD_DOCS = [
    [LONG, [120]],  # P: cut before 105 and before 110 (not at 10, 20); the rest, 9, and [120] fill an instance
    [list(range(130, 151)), [151, 152]],  # Q: 2.1 x the budget: pieces of 10, 10, a short rest [150] that joins
    [[160, *range(520, 531), 161, 162]],  # R: a word of 12 > the budget is cut anyway; the rest, 4, is not short
    [[170, 171], list(range(172, 193))],  # S: ends with a short rest [192]: joins T, or (doc-sentences) dropped
    [[200, 201]],  # T
    [list(range(240, 261)), list(range(261, 271))],  # V: the short rest [260] and the next 10 do not fit: dropped
    [list(range(210, 231))],  # U: the corpus ends with a short rest [230]: dropped in both modes
]
WORD_FULL = [
    [101, 501, 502, 102, 103, 503, 104], [105, 504, 505, 506, 106, 107, 108, 507, 109],
    [110, 508, 509, 111, 112, 113, 510, 114, 115, 120], list(range(130, 140)), list(range(140, 150)),
    [150, 151, 152], [160, *range(520, 529)], [529, 530, 161, 162, S, 170, 171], list(range(172, 182)),
    list(range(182, 192)), [192, S, 200, 201], list(range(240, 250)), list(range(250, 260)), list(range(261, 271)),
    list(range(210, 220)), list(range(220, 230)),
]
WORD_DOC = [
    *WORD_FULL[:7], [529, 530, 161, 162], [170, 171], list(range(172, 182)), list(range(182, 192)), [200, 201],
    *WORD_FULL[11:],
]


@pytest.mark.parametrize(("cross_documents", "expected", "dropped"),
                         [(True, WORD_FULL, [[260], [230]]), (False, WORD_DOC, [[192], [260], [230]])])
def test_over_long_sentences_by_hand(cross_documents: bool, expected: list[list[int]],
                                     dropped: list[list[int]]) -> None:
    """Cut at word starts; the short rest joins the next sentence, or is dropped (and counted) where none can."""
    wrapped = [[C, *content, S] for content in expected]
    assert restated_packing(WORD_DOCS, 12, cross_documents, WORDED) == (wrapped, dropped)
    packed = packed_instances(WORD_DOCS, 12, cross_documents, SPECIAL, WORDED)
    assert [inst.input_ids for inst in packed.instances] == wrapped
    assert (packed.dropped_pieces, packed.dropped_tokens) == (len(dropped), sum(map(len, dropped)))
    # Without the '##' marks LONG is cut at 10 and 20, mid-word, as before.
    blind = packed_instances([[LONG]], 12, cross_documents, SPECIAL).instances
    assert [inst.input_ids[1:-1] for inst in blind] == [LONG[:10], LONG[10:20], LONG[20:]]


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


def worded(docs: list[list[list[int]]], rng: random.Random) -> tuple[list[list[list[int]]], np.ndarray]:
    """The same shapes with every token a new id from 10 on (so a token tells its sentence), in words of 1 to
    4 pieces; returns them and `is_continuation` by id ('##' pieces: all of a word's pieces but the first)."""
    continuation = [False] * 10
    out = []
    for doc in docs:
        out.append([])
        for sentence in doc:
            first, end = len(continuation), len(continuation) + len(sentence)
            out[-1].append(list(range(first, end)))
            while len(continuation) < end:
                word = min(rng.randint(1, 4), end - len(continuation))
                continuation += [False] + [True] * (word - 1)
    return out, np.array(continuation, dtype=bool)


@pytest.mark.parametrize("seq_len", [10, 16, 64, 128])
@pytest.mark.parametrize("cross_documents", [True, False])
def test_packing_equals_the_restated_rule(seq_len: int, cross_documents: bool) -> None:
    budget = seq_len - 2
    docs, continuation = worded(random_documents(random.Random(seq_len), 120, budget), random.Random(seq_len))
    sizes = [sum(len(s) for s in doc) for doc in docs]
    assert min(sizes) < budget and budget in sizes and max(sizes) > budget
    assert any(len(s) > budget for doc in docs for s in doc)
    expected, dropped = restated_packing(docs, seq_len, cross_documents, continuation)
    packed = packed_instances(docs, seq_len, cross_documents, SPECIAL, continuation)
    got = [inst.input_ids for inst in packed.instances]
    assert len(got) == len(expected)
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"instance {index}"
    assert (packed.dropped_pieces, packed.dropped_tokens) == (len(dropped), sum(map(len, dropped)))
    # Nothing lost but the dropped pieces, nothing reordered, nothing too long; a [SEP] inside only between
    # documents.
    assert all(len(ids) <= seq_len and ids[0] == C and ids[-1] == S for ids in got)
    inner = [t for ids in got for t in ids[1:-1]]
    lost = {t for piece in dropped for t in piece}
    assert all(4 * len(piece) < seq_len for piece in dropped)
    assert [t for t in inner if t != S] == [t for doc in docs for sentence in doc for t in sentence if t not in lost]
    separators = inner.count(S)
    assert separators > 0 if cross_documents else separators == 0
    assert separators <= len(docs) - 1
    if not cross_documents:  # an instance never holds two documents
        assert len(got) >= len(docs) - len(dropped)
    # Words stay whole (every word here is shorter than a quarter of the budget), and an instance under a
    # quarter of seq_len holds whole sentences: what RoBERTa's rule leaves short, never a piece of one.
    sentence_of = {t: sentence for doc in docs for sentence in doc for t in sentence}
    assert not any(continuation[ids[1]] for ids in got)
    for ids in got:
        tokens = [t for t in ids[1:-1] if t != S]
        if 4 * len(tokens) < seq_len:
            assert all(set(sentence_of[t]) <= set(tokens) for t in tokens), ids


def test_packing_is_lazy_and_deterministic() -> None:
    """Documents come as a generator (the stage streams them from the memory-mapped corpus)."""
    docs = random_documents(random.Random(1), 40, 30)
    once = packed_instances((d for d in docs), 32, True, SPECIAL)
    assert once == packed_instances(docs, 32, True, SPECIAL)


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
    for inst in packed_instances(docs, 128, True, SPECIAL, continuation).instances:
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
