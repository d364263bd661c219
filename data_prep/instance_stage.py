"""Stage 2: tokenized input shards -> instances, one task per (input shard, sequence length).

A shard's instances are a pure function of (seed, sequence length, the shard's chunks, the NSP pool): each
chunk's rng is seeded from (seed, length, global chunk number) alone, so neither the worker count nor the
node count changes a byte. Random "next" segments come from a document of the same split in the same input
shard (`--nsp-scope shard`, the default, as google-research/bert's tool run once per input file; a group of
shards around it where the shard holds too few documents of the split: data_prep/nsp_pool.py), or in the
whole corpus (`--nsp-scope corpus`), never from A's own document while the split has another. A corpus of
one input shard is the same either way, and the same as every build before input shards.

`full-sentences` packs across documents, but only across the documents of one chunk and split: the packing
starts afresh at every chunk, so the output stays independent of how the work is spread. The cost is one
instance per chunk and split that may end short (one per `--docs-per-chunk` documents, 256 by default);
fairseq, which RoBERTa trained with, likewise packs each data shard on its own. The short pieces of
over-long sentences that packing drops (data_prep/instances.py: `packed_instances`) are counted in the
task's marker, which the manifest sums per length and split.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data_prep.batch_files import AtomicBatchWriter
from data_prep.config import NSP_SCOPE_SHARD, NUMPY_DRAWS, BuildConfig
from data_prep.corpus import TokenCorpus
from data_prep.corpus_index import CorpusIndex, corpus_index, held_out
from data_prep.instances import Instance, Packed, instances_from_document, packed_instances
from data_prep.keyed_order import BucketGroupedWriter, keyed_buckets, keyed_key, split_estimate
from data_prep.nsp_pool import NSP_POOL_DOCUMENTS, NspPool, PoolScope, corpus_scope, shard_scope
from data_prep.shard_format.masking import MaskedInstance, SpecialIds, mask_ids, mask_instance
from data_prep.shard_format.modes import FULL_SENTENCES, NSP
from data_prep.shard_format.shards import NO_NEXT_SENTENCE_LABEL, SPLITS, id_type, shard_schema
from data_prep.shard_format.vocab import Vocab, load_vocab
from data_prep.task_markers import write_marker
from data_prep.work_layout import VOCAB_NAME, instances_path, instances_stage, marker_path, tokens_path


@dataclass(frozen=True)
class InstanceSettings:
    """What decides a shard's instances besides its documents (from the build config)."""

    seed: int
    short_seq_prob: float
    val_fraction: float
    dupe_factor: int
    static_masking: bool
    mask_draws: str  # static masking: google (random.Random, as BERT) or numpy (the ranks' masker)
    mask_prob: float
    whole_word: bool
    segments: str
    nsp_scope: str

    @classmethod
    def of(cls, cfg: BuildConfig) -> InstanceSettings:
        return cls(cfg.seed, cfg.short_seq_prob, cfg.val_fraction, cfg.dupe_factor, cfg.static_masking,
                   cfg.mask_draws, cfg.mask_prob, cfg.whole_word, cfg.segments, cfg.nsp_scope)


@dataclass(frozen=True)
class InstanceTask:
    out: Path
    num_shards: int
    shard: int
    seq_len: int
    max_predictions: int
    settings: InstanceSettings


def instance_task_done(out: Path, seq_len: int, shard: int) -> bool:
    return marker_path(out, instances_stage(seq_len), shard).is_file()


def instance_marker(out: Path, seq_len: int, shard: int) -> dict:
    return json.loads(marker_path(out, instances_stage(seq_len), shard).read_text(encoding="utf-8"))


def nsp_pool_report(out: Path, seq_lens: tuple[int, ...] | list[int], num_shards: int) -> dict:
    """The manifest's `nsp_pools`, from the instance markers (data_prep/nsp_pool.py): the pool size a shard's
    own pool must reach, the input shards whose pool of a split was widened to a group of shards (counted at
    the first length; every length has the same groups), and the negatives whose B is from A's own document
    (only where the split has one document). Markers of an earlier version lack the keys: counted as 0."""
    markers = {seq_len: [instance_marker(out, seq_len, s) for s in range(num_shards)] for seq_len in seq_lens}
    first = markers[seq_lens[0]]
    return {
        "min_documents": NSP_POOL_DOCUMENTS,
        "shards_widened": {split: sum(m.get(f"{split}_pool_shards", 1) > 1 for m in first) for split in SPLITS},
        "self_draws": {str(seq_len): {split: sum(m.get(f"{split}_self_draws", 0) for m in found) for split in SPLITS}
                       for seq_len, found in markers.items()},
    }


@functools.lru_cache(maxsize=1)
def _whole_corpus(out: Path, num_shards: int) -> TokenCorpus:
    return TokenCorpus([tokens_path(out, s) for s in range(num_shards)])


@functools.lru_cache(maxsize=1)
def _corpus_pools(out: Path, num_shards: int, val_fraction: float, seed: int) -> PoolScope:
    return corpus_scope(corpus_index(out, num_shards), val_fraction, seed)


@functools.lru_cache(maxsize=2)
def _corpus_pool(out: Path, num_shards: int, val_fraction: float, seed: int, split: str) -> np.ndarray:
    """A split's documents over the corpus (8 bytes each), kept for the process's next tasks."""
    scope = _corpus_pools(out, num_shards, val_fraction, seed)
    return scope.pool(corpus_index(out, num_shards), split).documents


def _pools(task: InstanceTask, index: CorpusIndex, scope: PoolScope) -> NspPools:
    settings = task.settings
    if settings.nsp_scope == NSP_SCOPE_SHARD:
        return NspPools(scope, lambda split: scope.pool(index, split).documents)
    return NspPools(scope, lambda split: _corpus_pool(task.out, task.num_shards, settings.val_fraction,
                                                      settings.seed, split))


def _scope(task: InstanceTask, index: CorpusIndex) -> tuple[TokenCorpus, PoolScope, range]:
    """The documents a task draws from and splits, and the parts (chunks) of `corpus` that are its own
    (data_prep/nsp_pool.py: the shard's own file unless a pool of its had to be widened)."""
    span = index.spans[task.shard]
    settings = task.settings
    if settings.nsp_scope == NSP_SCOPE_SHARD or settings.segments != NSP:
        if settings.segments == NSP:
            scope = shard_scope(index, task.shard, settings.val_fraction, settings.seed)
        else:  # packing draws nothing: the shard alone
            kept = held_out(span.doc_start, span.documents, index.documents, settings.val_fraction, settings.seed)
            scope = PoolScope(range(task.shard, task.shard + 1), span.doc_start, kept, {})
        first = index.spans[scope.shards.start]
        corpus = TokenCorpus([tokens_path(task.out, s) for s in scope.shards], first_document=first.doc_start)
        own_first = span.chunk_base - first.chunk_base
        return corpus, scope, range(own_first, own_first + len(span.chunk_documents))
    corpus = _whole_corpus(task.out, task.num_shards)
    scope = _corpus_pools(task.out, task.num_shards, settings.val_fraction, settings.seed)
    return corpus, scope, range(span.chunk_base, span.chunk_base + len(span.chunk_documents))


def next_sentence_label(inst: Instance) -> int:
    """The shard's `next_sentence_label`: 1 random next, 0 is next, NO_NEXT_SENTENCE_LABEL none."""
    if inst.is_random_next is None:
        return NO_NEXT_SENTENCE_LABEL
    return 1 if inst.is_random_next else 0


def _columns(rows: list[Instance | tuple[Instance, MaskedInstance]], vocab_size: int, static: bool) -> pa.Table:
    schema = shard_schema(vocab_size, static)
    ids_type = id_type(vocab_size)
    if static:
        plain = [row[0] for row in rows]  # type: ignore[index]
        masked = [row[1] for row in rows]  # type: ignore[index]
        input_ids = [m.input_ids for m in masked]
    else:
        plain = rows  # type: ignore[assignment]
        input_ids = [inst.input_ids for inst in plain]
    columns = [
        pa.array(input_ids, type=pa.list_(ids_type)),
        pa.array([inst.a_len for inst in plain], type=pa.uint16()),
        pa.array([next_sentence_label(inst) for inst in plain], type=pa.int8()),
    ]
    if static:
        columns.append(pa.array([m.masked_positions for m in masked], type=pa.list_(pa.uint16())))
        columns.append(pa.array([m.masked_label_ids for m in masked], type=pa.list_(ids_type)))
    return pa.Table.from_arrays(columns, schema=schema)


# Instances held as Python objects before they become Arrow columns (~40 bytes per token as lists of
# ints; 8,192 instances at 512 are ~170 MB). A chunk counts documents, not tokens, so without a bound
# 256 books would be ~1 GB in one worker.
BATCH_ROWS = 8192
STATIC_MASK_SALT = 0x57A71C  # --mask-draws numpy: its generators, apart from the instances' own draws


class _RowBatches:
    """One split's instances, written to its file as a record batch every BATCH_ROWS rows. Shards are written
    as one record batch of their rows whatever the batching (write_shard_table), so no shard byte depends on
    BATCH_ROWS."""

    def __init__(self, vocab_size: int, static: bool, writer: AtomicBatchWriter) -> None:
        self._vocab_size = vocab_size
        self._static = static
        self._writer = writer
        self._pending: list[Instance | tuple[Instance, MaskedInstance]] = []

    def append(self, row: Instance | tuple[Instance, MaskedInstance]) -> None:
        self._pending.append(row)
        if len(self._pending) >= BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self._pending or self._writer.rows == 0:
            self._writer.write(_columns(self._pending, self._vocab_size, self._static))
        self._pending = []


def make_instances(task: InstanceTask) -> dict[str, int]:
    """All instances whose first tokens come from this shard's documents, chunk by chunk, per split: one file
    per split, a record batch per BATCH_ROWS instances, then the marker with the counts."""
    settings = task.settings
    vocab = load_vocab(task.out / VOCAB_NAME)
    ids = vocab.special_ids
    special = SpecialIds(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[PAD]"], ids["[UNK]"])
    index = corpus_index(task.out, task.num_shards)
    corpus, scope, parts = _scope(task, index)
    pools = _pools(task, index, scope)
    first_chunk = index.spans[task.shard].chunk_base
    schema = shard_schema(vocab.size, settings.static_masking)
    stats = {f"{split}_{key}": 0 for split in SPLITS for key in ("instances", "random_next")}
    dropped = {split: {"pieces": 0, "tokens": 0} for split in SPLITS}
    writers = {split: _writer(task, index, split, schema) for split in SPLITS}
    with writers["val"], writers["train"]:
        rows = {split: _RowBatches(vocab.size, settings.static_masking, writers[split]) for split in SPLITS}
        for local, part in enumerate(parts):
            rng = random.Random(f"instances:{settings.seed}:{task.seq_len}:{first_chunk + local}")
            masker = _masker(task, vocab, rng, first_chunk + local)
            documents = corpus.part_range(part)
            if settings.segments == NSP:
                made = _nsp_instances(task, corpus, documents, pools, special, rng)
            else:
                packed = _pack_splits(task, corpus, documents, scope, special, vocab.continuation_mask())
                for split, p in packed.items():
                    dropped[split]["pieces"] += p.dropped_pieces
                    dropped[split]["tokens"] += p.dropped_tokens
                made = _packed_rounds(packed, settings.dupe_factor)
            # Each instance is masked as soon as it is made, so the rng serves both in one fixed order.
            for split, inst in made:
                stats[f"{split}_instances"] += 1
                stats[f"{split}_random_next"] += inst.is_random_next is True
                if masker is not None:
                    rows[split].append((inst, masker(inst.input_ids)))
                else:
                    rows[split].append(inst)
        for split in SPLITS:
            rows[split].flush()
    marker = {**stats, "dropped": dropped} if settings.segments != NSP else {**stats, **pools.marker_entries()}
    for split, writer in writers.items():  # the keyed order: each bucket's rows (data_prep/keyed_order.py)
        if isinstance(writer, BucketGroupedWriter):
            marker[f"{split}_buckets"] = writer.counts.tolist()
    write_marker(task.out, marker_path(task.out, instances_stage(task.seq_len), task.shard), marker,
                 [writer.path for writer in writers.values()])
    return stats


def _writer(task: InstanceTask, index: CorpusIndex, split: str,
            schema: pa.Schema) -> AtomicBatchWriter | BucketGroupedWriter:
    """The split's instance file: grouped by bucket where the keyed order applies, else in the order made."""
    settings = task.settings
    path = instances_path(task.out, task.seq_len, task.shard, split)
    buckets = keyed_buckets(task.out, task.seq_len, split, lambda: split_estimate(
        index, split, task.seq_len, settings.dupe_factor, settings.val_fraction, settings.seed))
    if not buckets:
        return AtomicBatchWriter(path, schema)
    return BucketGroupedWriter(path, schema, task.shard, keyed_key(settings.seed, task.seq_len, split), buckets)


def _masker(task: InstanceTask, vocab: Vocab, rng: random.Random,
            chunk: int) -> Callable[[list[int]], MaskedInstance] | None:
    """Static masking's draws for one chunk (None: dynamic shards). google: the chunk's `rng`, which then serves
    the instances and their masks in one order (google-research/bert's bytes). numpy: the ranks' masker with a
    generator of its own per chunk, so the instances are a dynamic build's and only the masks are drawn apart."""
    settings = task.settings
    if not settings.static_masking:
        return None
    if settings.mask_draws == NUMPY_DRAWS:
        generator = np.random.default_rng([settings.seed, task.seq_len, chunk, STATIC_MASK_SALT])

        def numpy_draws(ids: list[int]) -> MaskedInstance:
            masked, positions, labels = mask_ids(np.asarray(ids, dtype=np.int64), vocab, settings.mask_prob,
                                                 task.max_predictions, settings.whole_word, generator)
            return MaskedInstance(masked.tolist(), positions.tolist(), labels.tolist())

        return numpy_draws
    continuation = vocab.continuation_mask() if settings.whole_word else None
    return lambda ids: mask_instance(ids, settings.mask_prob, task.max_predictions, vocab.special, vocab.size, rng,
                                     continuation)


def _nsp_instances(
    task: InstanceTask, corpus: TokenCorpus, documents: range, pools: NspPools, special: SpecialIds,
    rng: random.Random,
) -> Iterator[tuple[str, Instance]]:
    """BERT's pairs, document by document, `dupe_factor` rounds; random next from the same split's pool."""
    for _round in range(task.settings.dupe_factor):
        for doc in documents:
            split = pools.scope.split_of(doc)
            pool = pools.of(split)
            created = instances_from_document(
                doc,
                corpus.document,
                pool.draw,
                task.seq_len,
                task.settings.short_seq_prob,
                special,
                rng,
                pool.other_than,
            )
            for inst in created:
                yield split, inst


class NspPools:
    """A task's pools, made when a split first needs one (a split without documents here never reads its
    pool); `documents(split)` gives a pool's documents (cached per process in `--nsp-scope corpus`)."""

    def __init__(self, scope: PoolScope, documents: Callable[[str], np.ndarray]) -> None:
        self.scope = scope
        self._documents = documents
        self._pools: dict[str, NspPool] = {}

    def of(self, split: str) -> NspPool:
        if split not in self._pools:
            self._pools[split] = NspPool(self._documents(split))
        return self._pools[split]

    def marker_entries(self) -> dict[str, int]:
        """What the marker records of the pools: each split's widened group (input shards) and self-draws."""
        entries = {}
        for split in SPLITS:
            group = self.scope.groups.get(split, range(0))
            entries[f"{split}_pool_shards"] = len(group)
            entries[f"{split}_self_draws"] = self._pools[split].self_draws if split in self._pools else 0
        return entries


def _pack_splits(
    task: InstanceTask, corpus: TokenCorpus, documents: range, scope: PoolScope, special: SpecialIds,
    continuation,
) -> dict[str, Packed]:
    """The chunk's documents of each split packed in order (cut at word starts: `continuation`)."""
    return {
        split: packed_instances(
            (corpus.document(doc) for doc in documents if scope.split_of(doc) == split),
            task.seq_len,
            task.settings.segments == FULL_SENTENCES,
            special,
            continuation,
        )
        for split in SPLITS
    }


def _packed_rounds(packed: dict[str, Packed], dupe_factor: int) -> Iterator[tuple[str, Instance]]:
    """The packing draws nothing, so the `dupe_factor` rounds repeat the same instances: only static
    masking differs between them."""
    for _round in range(dupe_factor):
        for split in SPLITS:
            for inst in packed[split].instances:
                yield split, inst


