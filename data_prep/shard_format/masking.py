"""BERT's masked-LM rule, once: static masking at build time (data_prep/instance_stage.py) and dynamic masking in
the ranks' collate (pretrain/data/batches.py) both call this module, so they cannot drift apart.

The rule (google-research/bert `create_pretraining_data.py`): the candidates are every position but [CLS], [SEP]
and [PAD] (with whole-word masking, a word's '##' pieces join the piece before into one candidate); candidates
are taken in a random order while they fit, up to `prediction_count` positions; each chosen position becomes
[MASK] with probability 0.8, stays as it is with 0.1, and takes a random ordinary id with 0.1 (never a special
token: `never_replacements`), in that order of one uniform draw.

Two draw engines follow that rule:

- `mask_instance`, Python's `random.Random`, drawing exactly as google-research/bert does (a shuffle of every
  candidate, a rejection draw for a random id): the default static masking, whose bytes are pinned;
- `mask_ids`, a numpy `Generator`, one vectorised permutation and two array draws: the ranks' dynamic masking,
  and static masking with `--mask-draws numpy` (data_prep/instance_stage.py), which is faster and makes other
  (equally distributed) bytes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

MASK_BELOW = 0.8  # a draw below this: [MASK]
KEEP_BELOW = 0.9  # else below this: the token is kept; else a random ordinary id


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    mask: int
    pad: int
    unk: int


@dataclass(frozen=True)
class MaskedInstance:
    input_ids: list[int]
    masked_positions: list[int]
    masked_label_ids: list[int]


class MaskingVocab(Protocol):
    """What `mask_ids` reads of a vocab (data_prep/shard_format/vocab.py `Vocab`)."""

    @property
    def special(self) -> SpecialIds: ...

    @property
    def is_continuation(self) -> np.ndarray: ...

    @property
    def replacements(self) -> np.ndarray: ...


def prediction_count(length: int, mask_prob: float, max_predictions: int) -> int:
    """Positions to mask in an instance of `length` tokens: BERT's rounded share, at least 1, at most the slots."""
    return min(max_predictions, max(1, round(length * mask_prob)))


def never_replacements(special: SpecialIds) -> frozenset[int]:
    """The ids a random MLM replacement never takes, in static and dynamic masking alike: [CLS], [SEP], [PAD],
    [MASK] and [UNK]. None of them stands inside text, so a model shown one there would learn about the
    masking, not about the language."""
    return frozenset((special.cls, special.sep, special.pad, special.mask, special.unk))


def replacement_ids(vocab_size: int, special: SpecialIds) -> np.ndarray:
    """The ids a random replacement may take, ascending: every id but `never_replacements`. `mask_ids` indexes
    it with one vectorised draw; `mask_instance` draws from the same set by rejection, which keeps its draws
    (and the bytes of static shards) what they were."""
    never = np.fromiter(never_replacements(special), dtype=np.int64)
    return np.setdiff1d(np.arange(vocab_size, dtype=np.int64), never)


def mask_instance(
    input_ids: Sequence[int],
    mask_prob: float,
    max_predictions: int,
    special: SpecialIds,
    vocab_size: int,
    rng: random.Random,
    is_continuation: np.ndarray | None = None,
) -> MaskedInstance:
    """The rule drawn with `random.Random` as google-research/bert draws it (static masking's default).

    `is_continuation[id]` marks '##' pieces; when given, whole words are masked together.
    """
    specials = {special.cls, special.sep, special.pad}
    never_drawn = never_replacements(special)
    groups: list[list[int]] = []
    for pos, token in enumerate(input_ids):
        if token in specials:
            continue
        if is_continuation is not None and groups and is_continuation[token] and groups[-1][-1] == pos - 1:
            groups[-1].append(pos)
        else:
            groups.append([pos])
    rng.shuffle(groups)
    num_to_predict = prediction_count(len(input_ids), mask_prob, max_predictions)
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
        if draw < MASK_BELOW:
            output[pos] = special.mask
        elif draw < KEEP_BELOW:
            output[pos] = input_ids[pos]
        else:
            output[pos] = _random_ordinary_token(vocab_size, never_drawn, rng)
    return MaskedInstance(output, chosen, [int(input_ids[pos]) for pos in chosen])


def mask_ids(ids: np.ndarray, vocab: MaskingVocab, mask_prob: float, max_predictions: int, whole_word: bool,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule drawn with a numpy `Generator`, vectorised: (masked ids, positions, original ids there)."""
    special = vocab.special
    candidates = np.flatnonzero((ids != special.cls) & (ids != special.sep) & (ids != special.pad))
    target = prediction_count(len(ids), mask_prob, max_predictions)
    if whole_word and len(candidates):
        # A word = a piece not starting with "##" plus the "##" pieces right after it: masked together.
        starts = ~vocab.is_continuation[ids[candidates]] | (np.diff(candidates, prepend=-2) != 1)
        words = np.split(candidates, np.flatnonzero(starts)[1:])
        chosen: list[int] = []
        for w in rng.permutation(len(words)):
            if len(chosen) + len(words[w]) > target:
                continue
            chosen.extend(words[w].tolist())
        positions = np.sort(np.array(chosen, dtype=np.int64))
    else:
        positions = np.sort(rng.permutation(candidates)[:target])
    labels = ids[positions].copy()
    masked = ids.copy()
    roll = rng.random(len(positions))
    random_ids = vocab.replacements[rng.integers(0, len(vocab.replacements), len(positions))]
    masked[positions] = np.where(roll < MASK_BELOW, special.mask, np.where(roll < KEEP_BELOW, labels, random_ids))
    return masked, positions, labels


def _random_ordinary_token(vocab_size: int, excluded: frozenset[int], rng: random.Random) -> int:
    while True:
        token = rng.randrange(vocab_size)
        if token not in excluded:
            return token
