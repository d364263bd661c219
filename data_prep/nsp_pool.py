"""Where a random "next" segment comes from: the pool of documents of A's split that B is drawn from.

`--nsp-scope shard` (the default) draws from the input shard's own documents of the split, as
google-research/bert's tool run once per input file does. But a shard's pool can be tiny: a shard that
holds one book, or the held-out documents of a shard at a small `--val-fraction` (0.2 % of a shard of
800 books is one or two). BERT retries a draw that lands on A's own document ten times and then takes B
from A's document anyway, labelled "random": in a one-document pool every negative was A's own text.

So a split's pool is the shard's own when it holds at least NSP_POOL_DOCUMENTS documents of the split, and
otherwise that of the smallest group of consecutive input shards around it that does: shards are added
after it, then before it, alternately, until the group holds that many or is the whole corpus. The group
is a function of the corpus stage's counts (data_prep/corpus_index.py) alone, never of which worker or
node runs the task, so every executor builds the same bytes; a shard whose pools are large enough draws
exactly what it drew before. And a draw never ends on A itself while the pool holds another document: after
BERT's ten draws, B's document is drawn among the pool's others. Only a split with one document in the
whole group (the corpus, then) leaves A's own document: that is counted (`self_draws`) in the task's marker
and the manifest, as the widened pools are (`pool_shards`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np

from data_prep.corpus_index import CorpusIndex, held_out

# Documents of a split a pool holds at least, when the corpus has them. Large enough that a random next
# segment is rarely from a document met a few instances before, small enough that a group stays a few
# input shards (a shard of web text holds ~10^5 documents; the held-out books of a shard, one or two).
NSP_POOL_DOCUMENTS = 64


class NspPool:
    """The documents (global indices, ascending) a random next segment of one split is drawn from."""

    def __init__(self, documents: np.ndarray) -> None:
        self.documents = documents
        self.self_draws = 0  # negatives whose B had to come from A's own document (no other in the pool)

    def draw(self, rng: random.Random) -> int:
        """BERT's draw: uniform over the pool, A's own document included (the caller retries)."""
        return int(self.documents[rng.randrange(len(self.documents))])

    def other_than(self, document: int, rng: random.Random) -> int:
        """Uniform over the pool without `document`; `document` itself (counted) when it is the only one."""
        if len(self.documents) < 2:
            self.self_draws += 1
            return document
        at = int(np.searchsorted(self.documents, document))
        draw = rng.randrange(len(self.documents) - 1)
        return int(self.documents[draw + (draw >= at)])


@dataclass(frozen=True)
class PoolScope:
    """What an instance task of one input shard reads: the shards `shards` (consecutive; its own among them),
    which of their documents are held out, and per split the shards whose documents form its pool."""

    shards: range
    doc_start: int  # global index of the first document of `shards`
    held_out: np.ndarray  # per document of `shards`
    groups: dict[str, range]

    def split_of(self, document: int) -> str:
        return "val" if self.held_out[document - self.doc_start] else "train"

    def pool(self, index: CorpusIndex, split: str) -> NspPool:
        group = self.groups[split]
        first = index.spans[group.start].doc_start - self.doc_start
        last = index.spans[group.stop - 1].doc_end - self.doc_start
        chosen = self.held_out[first:last] if split == "val" else ~self.held_out[first:last]
        return NspPool(np.flatnonzero(chosen) + self.doc_start + first)


@functools.lru_cache(maxsize=4096)
def _split_sizes(doc_start: int, documents: int, num_documents: int, val_fraction: float, seed: int) -> dict[str, int]:
    val = int(held_out(doc_start, documents, num_documents, val_fraction, seed).sum())
    return {"train": documents - val, "val": val}


def pool_group(index: CorpusIndex, shard: int, split: str, val_fraction: float, seed: int,
               minimum: int = NSP_POOL_DOCUMENTS) -> range:
    """The consecutive input shards whose documents of `split` form `shard`'s pool (see the module doc)."""

    def size(s: int) -> int:
        span = index.spans[s]
        return _split_sizes(span.doc_start, span.documents, index.documents, val_fraction, seed)[split]

    first, stop = shard, shard + 1
    total = size(shard)
    while total < minimum and (first > 0 or stop < len(index.spans)):
        if stop < len(index.spans):
            total += size(stop)
            stop += 1
        if total < minimum and first > 0:
            first -= 1
            total += size(first)
    return range(first, stop)


def shard_scope(index: CorpusIndex, shard: int, val_fraction: float, seed: int) -> PoolScope:
    """`--nsp-scope shard`: each split's group (only for the splits the shard has documents of: a split it
    lacks draws nothing, and a corpus without held-out documents is never scanned for them)."""
    span = index.spans[shard]
    own = held_out(span.doc_start, span.documents, index.documents, val_fraction, seed)
    present = {"val": bool(own.any()), "train": not bool(own.all())}
    groups = {split: pool_group(index, shard, split, val_fraction, seed) if present[split] else range(shard, shard + 1)
              for split in present}
    shards = range(min(g.start for g in groups.values()), max(g.stop for g in groups.values()))
    if shards == range(shard, shard + 1):
        return PoolScope(shards, span.doc_start, own, groups)
    doc_start = index.spans[shards.start].doc_start
    documents = index.spans[shards.stop - 1].doc_end - doc_start
    return PoolScope(shards, doc_start, held_out(doc_start, documents, index.documents, val_fraction, seed), groups)


def corpus_scope(index: CorpusIndex, val_fraction: float, seed: int) -> PoolScope:
    """`--nsp-scope corpus`: one pool per split over every document."""
    everything = range(len(index.spans))
    return PoolScope(everything, 0, held_out(0, index.documents, index.documents, val_fraction, seed),
                     {"train": everything, "val": everything})
