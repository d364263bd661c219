"""Stage 2: tokenized input shards -> instances, one task per (input shard, sequence length).

A shard's instances are a pure function of (seed, sequence length, the shard's chunks, the NSP pool): each
chunk's rng is seeded from (seed, length, global chunk number) alone, so neither the worker count nor the
node count changes a byte. Random "next" segments come from a document of the same split in the same input
shard (`--nsp-scope shard`, the default, as google-research/bert's tool run once per input file), or in the
whole corpus (`--nsp-scope corpus`). A corpus of one input shard is the same either way, and the same as
every build before input shards.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from data_prep.atomic_io import atomic_write_json
from data_prep.batch_files import AtomicBatchWriter
from data_prep.config import FULL_SENTENCES, NSP, NSP_SCOPE_SHARD, BuildConfig
from data_prep.corpus import TokenCorpus
from data_prep.corpus_index import CorpusIndex, DocumentSplits, corpus_index
from data_prep.instances import (
    Instance,
    MaskedInstance,
    Packed,
    SpecialIds,
    instances_from_document,
    mask_instance,
    packed_instances,
)
from data_prep.shards import NO_NEXT_SENTENCE_LABEL, SPLITS, id_type, shard_schema
from data_prep.vocab import load_vocab
from data_prep.work_layout import VOCAB_NAME, instances_path, instances_stage, marker_path, tokens_path


@dataclass(frozen=True)
class InstanceSettings:
    """What decides a shard's instances besides its documents (from the build config)."""

    seed: int
    short_seq_prob: float
    val_fraction: float
    dupe_factor: int
    static_masking: bool
    mask_prob: float
    whole_word: bool
    segments: str
    nsp_scope: str

    @classmethod
    def of(cls, cfg: BuildConfig) -> InstanceSettings:
        return cls(cfg.seed, cfg.short_seq_prob, cfg.val_fraction, cfg.dupe_factor, cfg.static_masking,
                   cfg.mask_prob, cfg.whole_word, cfg.segments, cfg.nsp_scope)


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


@functools.lru_cache(maxsize=1)
def _whole_corpus(out: Path, num_shards: int) -> TokenCorpus:
    return TokenCorpus([tokens_path(out, s) for s in range(num_shards)])


@functools.lru_cache(maxsize=1)
def _corpus_splits(num_documents: int, val_fraction: float, seed: int) -> DocumentSplits:
    return DocumentSplits(0, num_documents, num_documents, val_fraction, seed)


def _scope(task: InstanceTask, index: CorpusIndex) -> tuple[TokenCorpus, DocumentSplits, range]:
    """The documents a task draws from and splits, and the parts (chunks) of `corpus` that are its own."""
    span = index.spans[task.shard]
    settings = task.settings
    if settings.nsp_scope == NSP_SCOPE_SHARD or settings.segments != NSP:
        corpus = TokenCorpus([tokens_path(task.out, task.shard)], first_document=span.doc_start)
        splits = DocumentSplits(span.doc_start, span.documents, index.documents, settings.val_fraction, settings.seed)
        return corpus, splits, range(len(span.chunk_documents))
    corpus = _whole_corpus(task.out, task.num_shards)
    splits = _corpus_splits(index.documents, settings.val_fraction, settings.seed)
    return corpus, splits, range(span.chunk_base, span.chunk_base + len(span.chunk_documents))


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
    continuation = vocab.continuation_mask() if settings.whole_word else None
    index = corpus_index(task.out, task.num_shards)
    corpus, splits, parts = _scope(task, index)
    first_chunk = index.spans[task.shard].chunk_base
    schema = shard_schema(vocab.size, settings.static_masking)
    stats = {f"{split}_{key}": 0 for split in SPLITS for key in ("instances", "random_next")}
    dropped = {split: {"pieces": 0, "tokens": 0} for split in SPLITS}
    writers = {split: AtomicBatchWriter(instances_path(task.out, task.seq_len, task.shard, split), schema)
               for split in SPLITS}
    with writers["val"], writers["train"]:
        rows = {split: _RowBatches(vocab.size, settings.static_masking, writers[split]) for split in SPLITS}
        for local, part in enumerate(parts):
            rng = random.Random(f"instances:{settings.seed}:{task.seq_len}:{first_chunk + local}")
            documents = corpus.part_range(part)
            if settings.segments == NSP:
                made = _nsp_instances(task, corpus, documents, splits, special, rng)
            else:
                packed = _pack_splits(task, corpus, documents, splits, special, vocab.continuation_mask())
                for split, p in packed.items():
                    dropped[split]["pieces"] += p.dropped_pieces
                    dropped[split]["tokens"] += p.dropped_tokens
                made = _packed_rounds(packed, settings.dupe_factor)
            # Each instance is masked as soon as it is made, so the rng serves both in one fixed order.
            for split, inst in made:
                stats[f"{split}_instances"] += 1
                stats[f"{split}_random_next"] += inst.is_random_next is True
                if settings.static_masking:
                    masked = mask_instance(inst.input_ids, settings.mask_prob, task.max_predictions, special,
                                           vocab.size, rng, continuation)
                    rows[split].append((inst, masked))
                else:
                    rows[split].append(inst)
        for split in SPLITS:
            rows[split].flush()
    marker = {**stats, "dropped": dropped} if settings.segments != NSP else stats
    atomic_write_json(marker_path(task.out, instances_stage(task.seq_len), task.shard), marker)
    return stats


def _nsp_instances(
    task: InstanceTask, corpus: TokenCorpus, documents: range, splits: DocumentSplits, special: SpecialIds,
    rng: random.Random,
) -> Iterator[tuple[str, Instance]]:
    """BERT's pairs, document by document, `dupe_factor` rounds; random next from the same split and scope."""
    for _round in range(task.settings.dupe_factor):
        for doc in documents:
            split = splits.split_of(doc)
            pool = splits.pools[split]
            created = instances_from_document(
                doc,
                corpus.document,
                lambda r, pool=pool: int(pool[r.randrange(len(pool))]),
                task.seq_len,
                task.settings.short_seq_prob,
                special,
                rng,
            )
            for inst in created:
                yield split, inst


def _pack_splits(
    task: InstanceTask, corpus: TokenCorpus, documents: range, splits: DocumentSplits, special: SpecialIds,
    continuation,
) -> dict[str, Packed]:
    """The chunk's documents of each split packed in order (cut at word starts: `continuation`)."""
    return {
        split: packed_instances(
            (corpus.document(doc) for doc in documents if splits.split_of(doc) == split),
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


