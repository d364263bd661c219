"""Pretraining instances as pure functions of (documents, explicit rng).

Three ways to build them (`--segments`): BERT's sentence pairs (`instances_from_document`), and
RoBERTa's FULL-SENTENCES and DOC-SENTENCES packing (`packed_instances`), which draws nothing.

NSP semantics follow google-research/bert `create_pretraining_data.py` (re-written here):
segments A and B are built from consecutive sentences of one document up to a target length
(`short_seq_prob` of the time a random shorter target); B is, half of the time and always when
only one segment is left, a span from a *different* random document (and the unused sentences
are put back); the pair is truncated to `seq_len - 3` by trimming the longer side at a random
end; the instance is `[CLS] A [SEP] B [SEP]`. Masking (any mode, static or dynamic) is BERT's rule in
data_prep/shard_format/masking.py, which the ranks' dynamic masking calls too.

Packed semantics follow RoBERTa (Liu et al. 2019, section 4.2) and fairseq's `complete` /
`complete_doc` block modes, re-stated at `packed_instances`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from data_prep.shard_format.masking import SpecialIds

Sentence = Sequence[int]
Document = Sequence[Sentence]


@dataclass(frozen=True)
class Instance:
    input_ids: list[int]
    a_len: int  # tokens of [CLS] A [SEP]; the whole instance when it has one segment (packed modes)
    is_random_next: bool | None  # None: no next-sentence label (packed modes, MLM only)


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
    pick_other_document: Callable[[int, random.Random], int] | None = None,
) -> list[Instance]:
    """All instances that start in document `doc_index` (BERT's create_instances_from_document).

    A random next segment's document is drawn up to ten times, as BERT does, while the draw is A's own;
    after that BERT takes B from A's own document. `pick_other_document(doc_index, rng)` replaces that last
    resort (data_prep/nsp_pool.py: another document of the pool, drawn); without it, BERT's behaviour."""
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
                for _ in range(10):  # BERT's retry count
                    other = pick_random_document(rng)
                    if other != doc_index:
                        break
                else:
                    if pick_other_document is not None:
                        other = pick_other_document(doc_index, rng)
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


@dataclass
class Packed:
    """What `packed_instances` made, and the text it left out: short pieces of over-long sentences that
    found no sentence to join (the manifest reports them per length and split)."""

    instances: list[Instance] = field(default_factory=list)
    dropped_pieces: int = 0
    dropped_tokens: int = 0


def sentence_pieces(sentence: Sentence, seq_len: int, is_continuation: np.ndarray | None) -> list[Sentence]:
    """`sentence` cut into pieces of at most the budget (`seq_len - 2`); `[sentence]` when it fits.

    Each cut goes before the first piece of a word (never before a '##' piece, which would start an
    instance mid-word), as late as the budget allows. Where that would leave a piece under a quarter of
    `seq_len` (the word the budget ends in is nearly as long as the budget, or longer), the cut goes at the
    budget, inside the word:
    a piece that short is not worth an instance. Only the last piece may be short.
    `is_continuation[id]` marks '##' pieces; None: every token starts a word.
    """
    budget = seq_len - 2
    shortest = -(-seq_len // 4)  # a quarter of seq_len, rounded up
    pieces: list[Sentence] = []
    start = 0
    while len(sentence) - start > budget:
        cut = start + budget
        while is_continuation is not None and cut - start >= shortest and is_continuation[sentence[cut]]:
            cut -= 1
        if cut - start < shortest:
            cut = start + budget
        pieces.append(sentence[start:cut])
        start = cut
    pieces.append(sentence[start:])
    return pieces


def packed_instances(
    documents: Iterable[Document],
    seq_len: int,
    cross_documents: bool,
    special: SpecialIds,
    is_continuation: np.ndarray | None = None,
) -> Packed:
    """RoBERTa's inputs without NSP: `[CLS] whole sentences [SEP]`, one segment, packed greedily.

    Sentences are taken in order and added to the instance being filled while its content stays
    within `seq_len - 2` tokens; the first sentence that does not fit starts the next instance.
    `cross_documents` (FULL-SENTENCES): the filling goes on into the next document, with one [SEP]
    between the last sentence of a document and the first of the next when both are in the same
    instance (never at an instance's start or end; it counts against the budget). Otherwise
    (DOC-SENTENCES) every document ends its last instance, which may be short.

    A sentence longer than the budget: fairseq's `complete` modes give it a block of its own, longer
    than the model takes, which fairseq's training iterator then skips. Here it is cut at word starts
    (`sentence_pieces`); every piece but the last is an instance of its own, and the last, the
    sentence's rest, is packed like a sentence: the sentences after it fill its instance. So no text
    is lost and no instance is longer than `seq_len`, with one exception: a last piece under a quarter
    of `seq_len` that no sentence joins (the end of the document in DOC-SENTENCES or of the chunk, or a
    next sentence that does not fit beside it, an over-long one included) would be an instance of a few
    tokens, mostly [CLS] and [SEP]. It is dropped and counted instead (`Packed.dropped_pieces`).

    Deterministic: no rng (RoBERTa's packing draws nothing; BERT's `short_seq_prob` does not apply).
    """
    budget = seq_len - 2
    packed = Packed()
    content: list[int] = []
    lone_short_piece = False  # `content` is only the short last piece of an over-long sentence

    def close() -> None:
        nonlocal lone_short_piece
        if lone_short_piece:
            packed.dropped_pieces += 1
            packed.dropped_tokens += len(content)
        elif content:
            ids = [special.cls, *content, special.sep]
            packed.instances.append(Instance(ids, len(ids), None))
        content.clear()
        lone_short_piece = False

    for document in documents:
        if not cross_documents:
            close()
        new_document = True
        for sentence in document:
            if not sentence:  # the tokenized corpus has none; nothing to pack, no separator to place
                continue
            *whole, rest = sentence_pieces(sentence, seq_len, is_continuation)
            for piece in whole:
                close()
                content.extend(piece)
                close()
            separator = [special.sep] if new_document and content else []
            new_document = False
            if len(content) + len(separator) + len(rest) > budget:
                close()
                separator = []
            joins = bool(content)
            content.extend(separator)
            content.extend(rest)
            lone_short_piece = bool(whole) and not joins and 4 * len(rest) < seq_len
    close()
    return packed
