"""Stage 1, per input shard: its documents -> cleaned sentences (text) -> vocab -> tokenized documents.

A shard's documents are cut into chunks of `docs_per_chunk` *input* documents in read order, so chunk
boundaries never depend on cleaning results, the worker count or the node count; each chunk is one record
batch of the shard's text and token files. A shard's files and its marker appear only when the shard is whole.

Who does the work (run_corpus_tasks): with at least as many input shards to do as workers, a corpus task per
shard (read, decompress, clean, tokenize: `corpus_task`) runs in each worker, W at a time, with one
`tokenizers` thread each, and the main process only hands out shard numbers; a serial main process reading
every document for the pool capped a machine at about 7 cores. With fewer shards than workers (a small corpus,
one SLURM element's last shards) the shard's chunks are spread over the pool instead (`clean_shards`) and the
tokens are made in the main process on W `tokenizers` threads (`tokenize_shards`), so that a single large input
still uses every core. Both make the same bytes: a chunk's text and ids do not depend on who makes them.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from data_prep.batch_files import AtomicBatchWriter, read_batches
from data_prep.config import BuildConfig
from data_prep.corpus import TEXT_SCHEMA, text_table, token_schema, token_table
from data_prep.corpus_index import DOCUMENTS_SKIPPED
from data_prep.documents import RawDocument, document_sentences
from data_prep.input_plan import InputPlan, InputUnit, read_shard
from data_prep.parallel import Workers
from data_prep.shard_format.atomic_io import atomic_write_bytes, sha256_file
from data_prep.shard_format.vocab import Vocab, VocabError, load_vocab, train_vocab
from data_prep.task_markers import write_marker
from data_prep.work_layout import CLEAN_STAGE, TOKENS_STAGE, VOCAB_NAME, marker_path, text_path, tokens_path

if TYPE_CHECKING:
    from tokenizers import Tokenizer

RAN_KEY = "ran"  # in the corpus stage's markers: ran()


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


# Text encoded per `encode_batch` call: ids are per sentence, so the cut changes no byte, but the call's
# Encoding objects and id lists (~200 bytes per token) then stay ~1 MB of text's worth, whatever the chunk holds
# (256 whole books are ~25 M tokens: ~5 GB in one call).
SUB_BATCH_BYTES = 1 << 20


@functools.lru_cache(maxsize=2)
def _tokenizer(vocab_path: str, lowercase: bool) -> Tokenizer:
    """The vocab's tokenizer (data_prep/shard_format/vocab.py) as the plain `tokenizers.Tokenizer` it wraps (the
    one OUT/tokenizer.json saves), which has `encode_batch_fast`: the same ids without the offsets."""
    from tokenizers import Tokenizer  # here: a process that never tokenizes never loads it

    return Tokenizer.from_str(Vocab(Path(vocab_path), (), lowercase).tokenizer().to_str())


def sub_batches(byte_offsets: np.ndarray, limit: int = SUB_BATCH_BYTES) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges of the strings whose UTF-8 offsets are `byte_offsets` (n + 1 of
    them), each about `limit` bytes of text (a longer string alone); no range is empty."""
    count = len(byte_offsets) - 1
    ranges, start = [], 0
    while start < count:
        end = int(np.searchsorted(byte_offsets, byte_offsets[start] + limit, side="right")) - 1
        end = min(count, max(end, start + 1))
        ranges.append((start, end))
        start = end
    return ranges


def _utf8_offsets(strings: pa.StringArray) -> np.ndarray:
    """Where each string of `strings` starts in its UTF-8 data (and where the last ends): n + 1 offsets."""
    if len(strings) == 0:
        return np.zeros(1, np.int64)
    return np.frombuffer(strings.buffers()[1], dtype=np.int32, count=len(strings) + 1,
                         offset=strings.offset * 4).astype(np.int64)


def tokenize_batch(table: pa.Table, tokenizer, vocab_size: int,
                   limit: int = SUB_BATCH_BYTES) -> tuple[pa.Table, dict[str, int]]:
    """One chunk's text -> its tokens, encoded `limit` bytes of text at a time into flat id arrays (nothing
    per token stays a Python object past its sub-batch); empty sentences dropped, and documents left empty."""
    column = table.column("sentences").combine_chunks()  # list<string>: documents of sentences
    flat = column.flatten()  # every sentence of the chunk, in order (Arrow strings, not Python ones)
    doc_sizes = np.diff(column.offsets.to_numpy()).astype(np.int64)
    dtype = np.dtype(token_schema(vocab_size).field("sentences").type.value_type.value_type.to_pandas_dtype())
    lengths_parts, token_parts = [], []
    for start, end in sub_batches(_utf8_offsets(flat), limit):
        encodings = tokenizer.encode_batch_fast(flat.slice(start, end - start).to_pylist(), add_special_tokens=False)
        ids = [encoding.ids for encoding in encodings]
        del encodings
        lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
        lengths_parts.append(lengths)
        token_parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum())))
    lengths = np.concatenate(lengths_parts) if lengths_parts else np.zeros(0, np.int64)
    tokens = np.concatenate(token_parts) if token_parts else np.zeros(0, dtype)
    keep = lengths > 0
    doc_index = np.repeat(np.arange(len(doc_sizes)), doc_sizes)
    per_doc = np.bincount(doc_index[keep], minlength=len(doc_sizes))
    stats = {"documents": int((per_doc > 0).sum()), "sentences": int(keep.sum()), "tokens": int(lengths.sum())}
    return token_table(tokens, lengths[keep], per_doc[per_doc > 0], vocab_size), stats


def _chunks(documents: Iterator[RawDocument], size: int) -> Iterator[list[RawDocument]]:
    while chunk := list(itertools.islice(documents, size)):
        yield chunk


class _ShardText:
    """The text file of the shard being cleaned: batches in chunk order, then its marker."""

    def __init__(self, out: Path, shard: int, units: list[str]) -> None:
        self.out, self.shard, self.units = out, shard, units
        self.started = time.time()
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
                     {**self.stats, "chunks": chunks, "input_files": self.units, RAN_KEY: ran(self.started)},
                     [self.writer.path])


def ran(started: float) -> dict[str, float | int]:
    """Who ran a task and when (wall clock): a trace of the schedule, read by people and tests, never by the
    build (markers are not output: nothing of it reaches the shards or the manifest)."""
    return {"pid": os.getpid(), "started": round(started, 3), "ended": round(time.time(), 3)}


def clean_shard(cfg: BuildConfig, shard: int, units: tuple[InputUnit, ...]) -> None:
    """One input shard's text file, read and cleaned chunk by chunk in this process (a corpus task's part)."""
    text = _ShardText(cfg.out_dir, shard, [u.label() for u in units])
    chunks = 0
    try:
        for chunks, documents in enumerate(_chunks(read_shard(cfg, units), cfg.docs_per_chunk), 1):
            text.add(clean_chunk(CleanTask(shard, chunks - 1, documents, cfg.min_doc_chars,
                                           skip_bad_files=cfg.skip_bad_files)))
    except BaseException:
        text.writer.__exit__(RuntimeError)  # an error mid-shard: no file, no marker
        raise
    text.finish(chunks)


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
    vocab = train_vocab(lambda: corpus_sentences(cfg.out_dir, num_shards), cfg.vocab_size, cfg.lowercase, target)
    return Vocab(vocab.path, vocab.tokens, cfg.lowercase)


def corpus_sentences(out: Path, num_shards: int) -> Iterator[str]:
    """The cleaned sentences in corpus order, read chunk by chunk only as far as the caller asks."""
    for shard in range(num_shards):
        reader = read_batches(text_path(out, shard))
        for batch in range(reader.num_record_batches):
            for document in reader.get_batch(batch).column("sentences").to_pylist():
                yield from document


@dataclass(frozen=True)
class TokenizeWith:
    """What a process needs to tokenize as the build does: the vocab file, its normalisation, its size."""

    path: str
    lowercase: bool
    size: int

    @classmethod
    def of(cls, vocab: Vocab) -> TokenizeWith:
        return cls(str(vocab.path), vocab.lowercase, vocab.size)


def tokenize_shard(out: Path, vocab: TokenizeWith, shard: int) -> dict[str, int]:
    """One input shard's token file from its text file, chunk by chunk, then its marker; returns its totals."""
    started = time.time()
    tokenizer = _tokenizer(vocab.path, vocab.lowercase)
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
    write_marker(out, marker_path(out, TOKENS_STAGE, shard),
                 {**stats, "chunk_documents": chunk_documents, RAN_KEY: ran(started)}, [tokens_path(out, shard)])
    return stats


def tokenize_shards(cfg: BuildConfig, vocab: Vocab, shards: list[int]) -> None:
    """Tokenize `shards` (those still missing) in this process: `tokenizers` spreads each sub-batch over its
    own threads (all cores, or RAYON_NUM_THREADS), so a chunk holding a few whole books is still tokenized on
    every core: the path for fewer shards than workers (run_corpus_tasks)."""
    out = cfg.out_dir
    todo = [s for s in shards if not marker_path(out, TOKENS_STAGE, s).is_file()]
    bar = tqdm(total=len(todo), desc="tokenize", unit="shard", mininterval=2)
    started, tokens = time.perf_counter(), 0
    try:
        for shard in todo:
            tokens += tokenize_shard(out, TokenizeWith.of(vocab), shard)["tokens"]
            bar.set_postfix_str(f"{tokens / max(1e-9, time.perf_counter() - started):.0f} tokens/s", refresh=False)
            bar.update(1)
    finally:
        bar.close()


@dataclass(frozen=True)
class CorpusTask:
    """One input shard's corpus work for one worker: read and clean it (unless done), then tokenize it (unless
    done, or `vocab` is None: a vocab still to be trained needs every shard's text first)."""

    cfg: BuildConfig
    shard: int
    units: tuple[InputUnit, ...]
    vocab: TokenizeWith | None


@dataclass(frozen=True)
class CorpusTaskResult:
    shard: int
    tokens: int
    clean_cpu_s: float  # CPU seconds of the worker's process (its every thread) in each part
    tokenize_cpu_s: float


def corpus_task(task: CorpusTask) -> CorpusTaskResult:
    """A whole corpus task in this process (a pool worker: RAYON_NUM_THREADS=1, data_prep/parallel.py)."""
    out = task.cfg.out_dir
    started = time.process_time()
    if not marker_path(out, CLEAN_STAGE, task.shard).is_file():
        clean_shard(task.cfg, task.shard, task.units)
    cleaned = time.process_time()
    tokens = 0
    if task.vocab is not None and not marker_path(out, TOKENS_STAGE, task.shard).is_file():
        tokens = tokenize_shard(out, task.vocab, task.shard)["tokens"]
    return CorpusTaskResult(task.shard, tokens, cleaned - started, time.process_time() - cleaned)


def run_corpus_tasks(cfg: BuildConfig, plan: InputPlan, shards: list[int], vocab: Vocab | None,
                     workers: Workers) -> dict[str, float]:
    """Clean and (with `vocab`) tokenize the `shards` not done: whole corpus tasks, W at a time, or with fewer
    shards than workers the chunks of each over the pool (module doc). Returns the CPU seconds of the clean
    and tokenize parts the workers' tasks report (empty on the chunk path, timed by the caller instead)."""
    out = cfg.out_dir
    stage = CLEAN_STAGE if vocab is None else TOKENS_STAGE
    todo = [s for s in shards if not marker_path(out, stage, s).is_file()]
    if workers.count > 1 and len(todo) < workers.count:
        clean_shards(cfg, plan, todo, workers)
        if vocab is not None:
            tokenize_shards(cfg, vocab, todo)
        return {}
    spec = TokenizeWith.of(vocab) if vocab is not None else None
    tasks = (CorpusTask(cfg, shard, plan.shards[shard], spec) for shard in todo)
    cpu = {"clean_cpu_s": 0.0, "tokenize_cpu_s": 0.0}
    bar = tqdm(total=len(todo), desc="corpus tasks", unit="shard", mininterval=2, dynamic_ncols=True)
    started, tokens = time.perf_counter(), 0
    # Every task handed to the pool at once (a task is a shard number and its files' names): a free worker takes
    # the next, so a long task never holds the others back as a bounded window of in-order results would.
    try:
        for result in workers.map(corpus_task, tasks, max_in_flight=max(1, len(todo))):
            cpu["clean_cpu_s"] += result.clean_cpu_s
            cpu["tokenize_cpu_s"] += result.tokenize_cpu_s
            tokens += result.tokens
            bar.set_postfix_str(f"{tokens / max(1e-9, time.perf_counter() - started):.0f} tokens/s", refresh=False)
            bar.update(1)
    finally:  # a task's error is then printed on a line of its own, not after the bar
        bar.close()
    return cpu
