"""Pretraining instances as pure functions of (documents, explicit rng).

Three ways to build them (`--segments`): BERT's sentence pairs (`instances_from_document`), and
RoBERTa's FULL-SENTENCES and DOC-SENTENCES packing (`packed_instances`), which draws nothing.

NSP semantics follow google-research/bert `create_pretraining_data.py` (re-written here):
segments A and B are built from consecutive sentences of one document up to a target length
(`short_seq_prob` of the time a random shorter target); B is, half of the time and always when
only one segment is left, a span from a *different* random document (and the unused sentences
are put back); the pair is truncated to `seq_len - 3` by trimming the longer side at a random
end; the instance is `[CLS] A [SEP] B [SEP]`. Masking (any mode) picks `mask_prob` (BERT: 15%) of
the positions among the non-special ones (whole words optionally), at most `max_predictions`, and
replaces 80% with [MASK], 10% with a random token, 10% unchanged.

Packed semantics follow RoBERTa (Liu et al. 2019, section 4.2) and fairseq's `complete` /
`complete_doc` block modes, re-stated at `packed_instances`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Sentence = Sequence[int]
Document = Sequence[Sentence]


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    mask: int
    pad: int
    unk: int


@dataclass(frozen=True)
class Instance:
    input_ids: list[int]
    a_len: int  # tokens of [CLS] A [SEP]; the whole instance when it has one segment (packed modes)
    is_random_next: bool | None  # None: no next-sentence label (packed modes, MLM only)


@dataclass(frozen=True)
class MaskedInstance:
    input_ids: list[int]
    masked_positions: list[int]
    masked_label_ids: list[int]


def truncate_pair(tokens_a: list[int], tokens_b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer segment (B on ties), from the front or the back at random, until the pair fits.

    Token by token, as BERT does, but on index windows so each step is O(1).
    """
    a_start, a_end, b_start, b_end = 0, len(tokens_a), 0, len(tokens_b)
    while (a_end - a_start) + (b_end - b_start) > max_tokens:
        trim_a = (a_end - a_start) > (b_end - b_start)
        front = rng.random() < 0.5
        if trim_a:
            a_start, a_end = (a_start + 1, a_end) if front else (a_start, a_end - 1)
        else:
            b_start, b_end = (b_start + 1, b_end) if front else (b_start, b_end - 1)
    tokens_a[:] = tokens_a[a_start:a_end]
    tokens_b[:] = tokens_b[b_start:b_end]


def instances_from_document(
    doc_index: int,
    get_document: Callable[[int], Document],
    pick_random_document: Callable[[random.Random], int],
    seq_len: int,
    short_seq_prob: float,
    special: SpecialIds,
    rng: random.Random,
) -> list[Instance]:
    """All instances that start in document `doc_index` (BERT's create_instances_from_document)."""
    document = get_document(doc_index)
    max_tokens = seq_len - 3
    target = max_tokens
    if rng.random() < short_seq_prob:
        target = rng.randint(2, max_tokens)
    instances: list[Instance] = []
    chunk: list[Sentence] = []
    chunk_len = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_len += len(document[i])
        if i == len(document) - 1 or chunk_len >= target:
            a_end = 1 if len(chunk) < 2 else rng.randint(1, len(chunk) - 1)
            tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
            tokens_b: list[int] = []
            is_random_next = len(chunk) == 1 or rng.random() < 0.5
            if is_random_next:
                target_b = target - len(tokens_a)
                other = doc_index
                for _ in range(10):  # BERT's retry count; a one-document split falls back to itself
                    other = pick_random_document(rng)
                    if other != doc_index:
                        break
                random_doc = get_document(other)
                start = rng.randint(0, len(random_doc) - 1)
                for k in range(start, len(random_doc)):  # index, not slice: documents are lazy
                    tokens_b.extend(random_doc[k])
                    if len(tokens_b) >= target_b:
                        break
                i -= len(chunk) - a_end  # the unused sentences start the next instance
            else:
                tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
            truncate_pair(tokens_a, tokens_b, max_tokens, rng)
            if tokens_a and tokens_b:
                ids = [special.cls, *tokens_a, special.sep, *tokens_b, special.sep]
                instances.append(Instance(ids, len(tokens_a) + 2, is_random_next))
            chunk, chunk_len = [], 0
        i += 1
    return instances


def packed_instances(
    documents: Iterable[Document], seq_len: int, cross_documents: bool, special: SpecialIds
) -> list[Instance]:
    """RoBERTa's inputs without NSP: `[CLS] whole sentences [SEP]`, one segment, packed greedily.

    Sentences are taken in order and added to the instance being filled while its content stays
    within `seq_len - 2` tokens; the first sentence that does not fit starts the next instance.
    `cross_documents` (FULL-SENTENCES): the filling goes on into the next document, with one [SEP]
    between the last sentence of a document and the first of the next when both are in the same
    instance (never at an instance's start or end; it counts against the budget). Otherwise
    (DOC-SENTENCES) every document ends its last instance, which may be short.

    A sentence longer than the budget is never packed with others: fairseq's `complete` modes give
    it a block of its own, longer than the model takes, which fairseq's training iterator then
    skips. Here its block is cut into consecutive pieces of the budget (the last one shorter), each
    an instance of its own, so no text is lost and no instance is longer than `seq_len`.

    Deterministic: no rng (RoBERTa's packing draws nothing; BERT's `short_seq_prob` does not apply).
    """
    budget = seq_len - 2
    instances: list[Instance] = []
    content: list[int] = []

    def close() -> None:
        if content:
            ids = [special.cls, *content, special.sep]
            instances.append(Instance(ids, len(ids), None))
            content.clear()

    for document in documents:
        if not cross_documents:
            close()
        first = True
        for sentence in document:
            if not sentence:  # the tokenized corpus has none; nothing to pack, no separator to place
                continue
            separator = [special.sep] if first and content else []
            first = False
            if len(sentence) > budget:
                close()
                for start in range(0, len(sentence), budget):
                    content.extend(sentence[start : start + budget])
                    close()
                continue
            if len(content) + len(separator) + len(sentence) > budget:
                close()
                separator = []
            content.extend(separator)
            content.extend(sentence)
    close()
    return instances


def mask_instance(
    input_ids: Sequence[int],
    mask_prob: float,
    max_predictions: int,
    special: SpecialIds,
    vocab_size: int,
    rng: random.Random,
    is_continuation: np.ndarray | None = None,
) -> MaskedInstance:
    """Static (or load-time dynamic) MLM masking with BERT's 80/10/10 rule.

    `is_continuation[id]` marks '##' pieces; when given, whole words are masked together.
    """
    specials = {special.cls, special.sep, special.pad}
    groups: list[list[int]] = []
    for pos, token in enumerate(input_ids):
        if token in specials:
            continue
        if is_continuation is not None and groups and is_continuation[token] and groups[-1][-1] == pos - 1:
            groups[-1].append(pos)
        else:
            groups.append([pos])
    rng.shuffle(groups)
    num_to_predict = min(max_predictions, max(1, round(len(input_ids) * mask_prob)))
    chosen: list[int] = []
    for group in groups:
        if len(chosen) >= num_to_predict:
            break
        if len(chosen) + len(group) > num_to_predict:
            continue
        chosen.extend(group)
    chosen.sort()
    output = list(input_ids)
    for pos in chosen:
        draw = rng.random()
        if draw < 0.8:
            output[pos] = special.mask
        elif draw < 0.9:
            output[pos] = input_ids[pos]
        else:
            output[pos] = _random_ordinary_token(vocab_size, specials | {special.mask, special.unk}, rng)
    return MaskedInstance(output, chosen, [int(input_ids[pos]) for pos in chosen])


def _random_ordinary_token(vocab_size: int, excluded: set[int], rng: random.Random) -> int:
    while True:
        token = rng.randrange(vocab_size)
        if token not in excluded:
            return token
