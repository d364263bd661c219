"""Stage 1, per input shard: its documents -> cleaned sentences (text) -> vocab -> tokenized documents.

A shard's documents are cut into chunks of `docs_per_chunk` *input* documents in read order, so chunk
boundaries never depend on cleaning results, the worker count or the node count. The chunks of the shards a
process runs are cleaned by its pool in order and written as one record batch each; the tokens follow
chunk by chunk. A shard's files and its marker appear only when the shard is whole.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from data_prep.batch_files import AtomicBatchWriter, read_batches
from data_prep.config import BuildConfig
from data_prep.corpus import TEXT_SCHEMA, text_table, token_schema, token_table
from data_prep.corpus_index import DOCUMENTS_SKIPPED
from data_prep.documents import RawDocument, document_sentences
from data_prep.input_plan import InputPlan, read_shard
from data_prep.parallel import Workers
from data_prep.shard_format.atomic_io import atomic_write_bytes, sha256_file
from data_prep.shard_format.vocab import Vocab, VocabError, load_vocab, train_vocab
from data_prep.task_markers import write_marker
from data_prep.work_layout import CLEAN_STAGE, TOKENS_STAGE, VOCAB_NAME, marker_path, text_path, tokens_path


@dataclass(frozen=True)
class CleanTask:
    shard: int
    chunk: int  # within the shard
    documents: list[RawDocument]
    min_doc_chars: int
    last: bool = False  # no documents: marks the end of the shard (`chunk` is then its number of chunks)
    skip_bad_files: bool = False  # a document over a cap is left out and counted, instead of stopping the build


@dataclass(frozen=True)
class CleanedChunk:
    task: CleanTask
    table: pa.Table | None
    stats: dict[str, int]


def clean_chunk(task: CleanTask) -> CleanedChunk:
    """Raw documents -> sentences; short documents dropped and counted. Pure; runs in the pool."""
    if task.last:
        return CleanedChunk(task, None, {})
    titles: list[str] = []
    kept: list[list[str]] = []
    dropped = skipped = 0
    for doc in task.documents:
        sentences = document_sentences(doc, task.skip_bad_files)
        if sentences is None:
            skipped += 1
            continue
        if sum(len(s) for s in sentences) < max(1, task.min_doc_chars):
            dropped += 1
            continue
        titles.append(doc.title)
        kept.append(sentences)
    stats = {
        "input_documents": len(task.documents),
        "documents_dropped_short": dropped,
        "characters": sum(len(s) for doc in kept for s in doc),
    }
    if skipped:  # recorded only when some were: the markers (and manifests) of clean builds stay as they were
        stats[DOCUMENTS_SKIPPED] = skipped
    return CleanedChunk(task, text_table(titles, kept), stats)


@functools.lru_cache(maxsize=2)
def _tokenizer(vocab_path: str, lowercase: bool):
    return Vocab(Path(vocab_path), (), lowercase).tokenizer()


def tokenize_batch(table: pa.Table, tokenizer, vocab_size: int) -> tuple[pa.Table, dict[str, int]]:
    """One chunk's text -> its tokens: one batch-encode call; empty sentences dropped, and documents left empty."""
    docs_text: list[list[str]] = table.column("sentences").to_pylist()
    flat = [sentence for doc in docs_text for sentence in doc]
    encodings = tokenizer.encode_batch(flat, add_special_tokens=False)
    ids = [encoding.ids for encoding in encodings]
    lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
    keep = lengths > 0
    doc_index = np.repeat(np.arange(len(docs_text)), [len(doc) for doc in docs_text])
    per_doc = np.bincount(doc_index[keep], minlength=len(docs_text))
    tokens = np.fromiter(
        itertools.chain.from_iterable(ids),  # empty sentences add nothing
        dtype=np.int64, count=int(lengths.sum()),
    )
    stats = {"documents": int((per_doc > 0).sum()), "sentences": int(keep.sum()), "tokens": int(lengths.sum())}
    return token_table(tokens, lengths[keep], per_doc[per_doc > 0], vocab_size), stats


def _chunks(documents: Iterator[RawDocument], size: int) -> Iterator[list[RawDocument]]:
    while chunk := list(itertools.islice(documents, size)):
        yield chunk


class _ShardText:
    """The text file of the shard being cleaned: batches in chunk order, then its marker."""

    def __init__(self, out: Path, shard: int, units: list[str]) -> None:
        self.out, self.shard, self.units = out, shard, units
        self.stats = {"input_documents": 0, "documents_dropped_short": 0, "characters": 0}
        self.writer = AtomicBatchWriter(text_path(out, shard), TEXT_SCHEMA).__enter__()

    def add(self, result: CleanedChunk) -> None:
        assert result.table is not None
        self.writer.write(result.table)
        for key, value in result.stats.items():
            self.stats[key] = self.stats.get(key, 0) + value

    def finish(self, chunks: int) -> None:
        self.writer.__exit__(None)
        write_marker(self.out, marker_path(self.out, CLEAN_STAGE, self.shard),
                     {**self.stats, "chunks": chunks, "input_files": self.units}, [self.writer.path])


def clean_shards(cfg: BuildConfig, plan: InputPlan, shards: list[int], workers: Workers) -> None:
    """The text files of `shards` still missing; each reads its own input files and nothing else."""
    out = cfg.out_dir
    todo = [s for s in shards if not marker_path(out, CLEAN_STAGE, s).is_file()]
    if not todo:
        return
    bar = tqdm(desc="clean", unit="doc", mininterval=2, dynamic_ncols=True)
    started, chars = time.perf_counter(), 0

    def tasks() -> Iterator[CleanTask]:
        for shard in todo:
            chunks = 0
            for chunks, documents in enumerate(_chunks(read_shard(cfg, plan.shards[shard]), cfg.docs_per_chunk), 1):
                yield CleanTask(shard, chunks - 1, documents, cfg.min_doc_chars, skip_bad_files=cfg.skip_bad_files)
            yield CleanTask(shard, chunks, [], cfg.min_doc_chars, last=True)

    current: _ShardText | None = None
    try:
        for result in workers.map(clean_chunk, tasks()):
            task = result.task
            if current is None:
                current = _ShardText(out, task.shard, [u.label() for u in plan.shards[task.shard]])
            if task.last:
                current.finish(task.chunk)
                current = None
                continue
            current.add(result)
            chars += result.stats["characters"]
            bar.update(result.stats["input_documents"])
            bar.set_postfix_str(f"{chars / max(1e-9, time.perf_counter() - started) / 1e6:.2f} MB/s", refresh=False)
    finally:
        if current is not None:  # an error mid-shard: no file, no marker
            current.writer.__exit__(RuntimeError)
        bar.close()


def prepare_vocab(cfg: BuildConfig, num_shards: int) -> Vocab:
    """OUT/vocab.txt: a copy of --vocab, or WordPiece trained on the cleaned text (once)."""
    target = cfg.out_dir / VOCAB_NAME
    if cfg.vocab is not None:
        given = load_vocab(cfg.vocab)
        if target.is_file() and sha256_file(target) != sha256_file(given.path):
            raise VocabError(
                f"--vocab {given.path}: differs from {target}, which this output folder was built with"
            )
        if not target.is_file():  # nodes may race here: unique temp names, identical bytes
            atomic_write_bytes(target, given.path.read_bytes())
        return load_vocab(target)
    if target.is_file():
        vocab = load_vocab(target)
        return Vocab(vocab.path, vocab.tokens, cfg.lowercase)

    assert cfg.vocab_size is not None
    vocab = train_vocab(corpus_sentences(cfg.out_dir, num_shards), cfg.vocab_size, cfg.lowercase, target)
    return Vocab(vocab.path, vocab.tokens, cfg.lowercase)


def corpus_sentences(out: Path, num_shards: int) -> Iterator[str]:
    """The cleaned sentences in corpus order, read chunk by chunk only as far as the caller asks."""
    for shard in range(num_shards):
        reader = read_batches(text_path(out, shard))
        for batch in range(reader.num_record_batches):
            for document in reader.get_batch(batch).column("sentences").to_pylist():
                yield from document


def tokenize_shards(cfg: BuildConfig, vocab: Vocab, shards: list[int]) -> None:
    """Tokenize `shards` (those still missing) in this process: `tokenizers` spreads each chunk's batch over
    its own threads (RAYON_NUM_THREADS = --workers), so a chunk holding a few whole books is still
    tokenized on every core, which one process per chunk could not do."""
    out = cfg.out_dir
    todo = [s for s in shards if not marker_path(out, TOKENS_STAGE, s).is_file()]
    bar = tqdm(total=len(todo), desc="tokenize", unit="shard", mininterval=2)
    started, tokens, docs = time.perf_counter(), 0, 0
    tokenizer = _tokenizer(str(vocab.path), vocab.lowercase)
    for shard in todo:
        stats = {"documents": 0, "sentences": 0, "tokens": 0}
        chunk_documents: list[int] = []
        reader = read_batches(text_path(out, shard))
        with AtomicBatchWriter(tokens_path(out, shard), token_schema(vocab.size)) as writer:
            for batch in range(reader.num_record_batches):
                table, chunk_stats = tokenize_batch(pa.Table.from_batches([reader.get_batch(batch)]), tokenizer,
                                                    vocab.size)
                writer.write(table)
                chunk_documents.append(table.num_rows)
                for key, value in chunk_stats.items():
                    stats[key] += value
        write_marker(out, marker_path(out, TOKENS_STAGE, shard), {**stats, "chunk_documents": chunk_documents},
                     [tokens_path(out, shard)])
        tokens += stats["tokens"]
        docs += stats["documents"]
        elapsed = max(1e-9, time.perf_counter() - started)
        bar.set_postfix_str(f"{docs / elapsed:.0f} docs/s {tokens / elapsed:.0f} tokens/s", refresh=False)
        bar.update(1)
    bar.close()
