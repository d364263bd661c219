"""Stage 1: sources -> cleaned sentences (text parts) -> vocab -> tokenized corpus (token parts).

Documents are cut into chunks of `docs_per_chunk` *input* documents in source order, so chunk
boundaries never depend on cleaning results, the worker count or the node count. Node `r` of
`n` owns the chunks with `index % n == r`.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_prep.atomic_io import atomic_write_bytes, sha256_file
from data_prep.config import BuildConfig
from data_prep.corpus import (
    merge_stats,
    part_stats,
    read_table,
    text_part_path,
    token_part_path,
    write_text_part,
    write_token_part,
)
from data_prep.parallel import Workers
from data_prep.sources import SOURCES, RawDocument, ReadContext, to_sentences
from data_prep.vocab import Vocab, VocabError, load_vocab, train_vocab

VOCAB_NAME = "vocab.txt"


def iter_documents(cfg: BuildConfig) -> Iterator[RawDocument]:
    """Every input document in a fixed order: SOURCES' rows in turn, each row's values as given."""
    for row in SOURCES:
        context = ReadContext(cfg.skip_bad_files, {o.field: cfg.input_option(o.field, o.default) for o in row.options})
        for value in cfg.input_values(row.field):
            yield from row.read(value, context)


@dataclass(frozen=True)
class CleanTask:
    out: Path
    chunk: int
    documents: list[RawDocument]
    min_doc_chars: int


def clean_chunk(task: CleanTask) -> dict[str, int]:
    """Raw documents -> sentences; short documents dropped and counted. Pure; writes one part."""
    titles: list[str] = []
    kept: list[list[str]] = []
    dropped = 0
    for doc in task.documents:
        sentences = to_sentences(doc)
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
    write_text_part(text_part_path(task.out, task.chunk), titles, kept, stats)
    return stats


@functools.lru_cache(maxsize=2)
def _tokenizer(vocab_path: str, lowercase: bool):
    return Vocab(Path(vocab_path), (), lowercase).tokenizer()


@dataclass(frozen=True)
class TokenizeTask:
    out: Path
    chunk: int
    vocab_path: str
    vocab_size: int
    lowercase: bool


def tokenize_chunk(task: TokenizeTask) -> dict[str, int]:
    """Text part -> token part: one batch-encode call per chunk; empty sentences dropped."""
    table = read_table(text_part_path(task.out, task.chunk))
    docs_text: list[list[str]] = table.column("sentences").to_pylist()
    flat = [sentence for doc in docs_text for sentence in doc]
    encodings = _tokenizer(task.vocab_path, task.lowercase).encode_batch(flat, add_special_tokens=False)
    ids = [encoding.ids for encoding in encodings]
    lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
    # Empty sentences (only characters the tokenizer drops) are removed; so are documents left empty.
    keep = lengths > 0
    doc_index = np.repeat(np.arange(len(docs_text)), [len(doc) for doc in docs_text])
    per_doc = np.bincount(doc_index[keep], minlength=len(docs_text))
    tokens = np.fromiter(
        itertools.chain.from_iterable(ids),  # empty sentences add nothing
        dtype=np.int64, count=int(lengths.sum()),
    )
    stats = {
        "documents": int((per_doc > 0).sum()),
        "sentences": int(keep.sum()),
        "tokens": int(lengths.sum()),
    }
    write_token_part(
        token_part_path(task.out, task.chunk), tokens, lengths[keep], per_doc[per_doc > 0], task.vocab_size, stats
    )
    return stats


def _chunks(cfg: BuildConfig) -> Iterator[tuple[int, list[RawDocument]]]:
    documents = iter_documents(cfg)
    for index in itertools.count():
        chunk = list(itertools.islice(documents, cfg.docs_per_chunk))
        if not chunk:
            return
        yield index, chunk


def clean_all(cfg: BuildConfig, workers: Workers) -> int:
    """Make this node's text parts (skipping finished ones); returns the total number of chunks."""
    out = cfg.out_dir
    num_chunks = 0
    bar = tqdm(desc="clean", unit="doc", mininterval=2, dynamic_ncols=True)
    started = time.perf_counter()
    chars = 0

    def tasks() -> Iterator[CleanTask]:
        nonlocal num_chunks
        for index, documents in _chunks(cfg):
            num_chunks = index + 1
            mine = index % cfg.num_nodes == cfg.node_rank
            if not mine or text_part_path(out, index).is_file():
                bar.update(len(documents))
                continue
            yield CleanTask(out, index, documents, cfg.min_doc_chars)

    for stats in workers.map(clean_chunk, tasks()):
        chars += stats["characters"]
        bar.update(stats["input_documents"])
        bar.set_postfix_str(f"{chars / max(1e-9, time.perf_counter() - started) / 1e6:.2f} MB/s", refresh=False)
    bar.close()
    return num_chunks


def prepare_vocab(cfg: BuildConfig, num_chunks: int) -> Vocab:
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

    def sentences() -> Iterator[str]:
        for chunk in range(num_chunks):
            for doc in read_table(text_part_path(cfg.out_dir, chunk)).column("sentences").to_pylist():
                yield from doc

    assert cfg.vocab_size is not None
    vocab = train_vocab(sentences(), cfg.vocab_size, cfg.lowercase, target)
    return Vocab(vocab.path, vocab.tokens, cfg.lowercase)


def tokenize_all(cfg: BuildConfig, vocab: Vocab, num_chunks: int) -> None:
    """Tokenize this node's chunks in this process: `tokenizers` spreads each chunk's batch over
    its own threads (RAYON_NUM_THREADS = --workers), so a chunk holding a few whole books is
    still tokenized on every core, which one process per chunk could not do."""
    out = cfg.out_dir
    mine = [c for c in range(num_chunks) if c % cfg.num_nodes == cfg.node_rank]
    todo = [c for c in mine if not token_part_path(out, c).is_file()]
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc="tokenize", unit="chunk", mininterval=2)
    started, tokens, docs = time.perf_counter(), 0, 0
    tasks = (TokenizeTask(out, c, str(vocab.path), vocab.size, vocab.lowercase) for c in todo)
    for stats in map(tokenize_chunk, tasks):
        tokens += stats["tokens"]
        docs += stats["documents"]
        elapsed = max(1e-9, time.perf_counter() - started)
        bar.set_postfix_str(f"{docs / elapsed:.0f} docs/s {tokens / elapsed:.0f} tokens/s", refresh=False)
        bar.update(1)
    bar.close()


def corpus_stats(out: Path, num_chunks: int) -> dict[str, int]:
    return merge_stats(
        [
            part_stats(path)
            for chunk in range(num_chunks)
            for path in (text_part_path(out, chunk), token_part_path(out, chunk))
        ]
    )
