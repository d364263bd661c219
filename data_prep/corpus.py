"""The intermediate corpora under OUT/work/, one Arrow file per chunk of input documents.

    work/text/part-NNNNN.arrow     cleaned documents: title (string), sentences (list<string>)
    work/tokens/part-NNNNN.arrow   the tokenized corpus: sentences (list<list<uint16|uint32>>)

A part exists only when complete (atomic rename), which is what makes a killed build resumable.
The tokenized corpus is made once and read, memory-mapped, by every sequence length.
Chunk statistics travel in the Arrow schema metadata so that no side file can disagree.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from data_prep.shards import id_type, read_row_count, read_table, write_shard_table

TEXT_SCHEMA = pa.schema([pa.field("title", pa.string()), pa.field("sentences", pa.list_(pa.string()))])


def text_part_path(out: Path, chunk: int) -> Path:
    return out / "work" / "text" / f"part-{chunk:05d}.arrow"


def token_part_path(out: Path, chunk: int) -> Path:
    return out / "work" / "tokens" / f"part-{chunk:05d}.arrow"


def write_text_part(path: Path, titles: list[str], sentences: list[list[str]], stats: dict[str, int]) -> None:
    schema = TEXT_SCHEMA.with_metadata({"stats": json.dumps(stats, sort_keys=True)})
    table = pa.Table.from_pydict({"title": titles, "sentences": sentences}, schema=schema)
    write_shard_table(path, table)


def write_token_part(
    path: Path, tokens: np.ndarray, sentence_lengths: np.ndarray, doc_sentence_counts: np.ndarray,
    vocab_size: int, stats: dict[str, int],
) -> None:
    """Documents as nested lists built from flat arrays (no per-token Python objects)."""
    ids = id_type(vocab_size)
    sentence_offsets = np.concatenate([[0], np.cumsum(sentence_lengths)]).astype(np.int32)
    doc_offsets = np.concatenate([[0], np.cumsum(doc_sentence_counts)]).astype(np.int32)
    sentences = pa.ListArray.from_arrays(pa.array(sentence_offsets), pa.array(tokens, type=ids))
    docs = pa.ListArray.from_arrays(pa.array(doc_offsets), sentences)
    schema = pa.schema([pa.field("sentences", pa.list_(pa.list_(ids)))]).with_metadata(
        {"stats": json.dumps(stats, sort_keys=True)}
    )
    write_shard_table(path, pa.Table.from_arrays([docs], schema=schema))


def part_stats(path: Path) -> dict[str, int]:
    table = read_table(path)
    return json.loads(table.schema.metadata[b"stats"])


class LazyDocument(Sequence[list[int]]):
    """One tokenized document; sentences become Python lists only when asked for."""

    def __init__(self, tokens: np.ndarray, sentence_offsets: np.ndarray) -> None:
        self._tokens = tokens
        self._offsets = sentence_offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return self._tokens[self._offsets[index] : self._offsets[index + 1]].tolist()


def mapped_list_column(path: Path, name: str) -> pa.ListArray:
    """One list column of an Arrow file as a single array over the file's memory map.

    A part is written as one record batch, so its column has one chunk and `.chunk(0)` is a view of
    the mapped file. `combine_chunks()` would copy it into the worker's own memory: every worker held
    a private copy of the whole token corpus (~2 bytes per token each) that the page cache shares.
    """
    column = read_table(path).column(name)
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks()  # never written so (one batch per file); zero chunks when empty


def nested_list_arrays(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document offsets, sentence offsets, tokens) of a list<list<ids>> column, as numpy views.

    The views are made on the Arrow buffers themselves, so that what a worker keeps per token part is
    three small buffer objects, not the Arrow arrays behind `to_numpy` (about 1.2 instead of 2.8 KiB
    per part: with many small chunks, that per-part cost is what grows with the corpus). Offsets are
    absolute in the child arrays, so each view starts at its own array's offset.
    """
    sentences = column.values
    tokens = sentences.values
    if len(tokens) == 0:  # a part whose documents were all dropped: buffers may be absent
        return column.offsets.to_numpy(), sentences.offsets.to_numpy(), tokens.to_numpy(zero_copy_only=False)
    # buffers(): list validity, list offsets, sentence validity, sentence offsets, ids validity, ids
    buffers = column.buffers()
    id_dtype = np.dtype(tokens.type.to_pandas_dtype())
    return (
        np.frombuffer(buffers[1], dtype=np.int32, count=len(column) + 1, offset=column.offset * 4),
        np.frombuffer(buffers[3], dtype=np.int32, count=len(sentences) + 1, offset=sentences.offset * 4),
        np.frombuffer(buffers[5], dtype=id_dtype, count=len(tokens), offset=tokens.offset * id_dtype.itemsize),
    )


MAX_MAPPED_PARTS = 1024  # token parts one process keeps mapped at a time (Linux allows 65,530 maps in all)


class TokenCorpus:
    """All token parts, addressed by a global document index: views of memory-mapped files, no copies.

    Why a bound on the mapped parts: an instance worker draws random next segments from every document, so it
    reads every part, and one mapping per part would reach Linux's default limit of 65,530 maps
    (`vm.max_map_count`) at about 16.7 M documents (256 a part): a C4-sized corpus would fail outright. So at
    most `max_mapped` parts stay mapped, the least recently read unmapped first (a mapping lives on while a
    document read from it does). What is read is the same bytes either way, so no instance changes.
    """

    def __init__(self, paths: list[Path], max_mapped: int = MAX_MAPPED_PARTS) -> None:
        self._paths = paths
        self._max_mapped = max(1, max_mapped)
        self._mapped: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        starts = [0]
        for path in paths:
            starts.append(starts[-1] + read_row_count(path))
        self._starts = starts

    def __len__(self) -> int:
        return self._starts[-1]

    def part_range(self, part: int) -> range:
        return range(self._starts[part], self._starts[part + 1])

    def _part(self, part: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        arrays = self._mapped.get(part)
        if arrays is None:
            arrays = nested_list_arrays(mapped_list_column(self._paths[part], "sentences"))
            self._mapped[part] = arrays
            while len(self._mapped) > self._max_mapped:
                self._mapped.popitem(last=False)
        else:
            self._mapped.move_to_end(part)
        return arrays

    def document(self, index: int) -> LazyDocument:
        part = bisect_right(self._starts, index) - 1
        doc_offsets, sentence_offsets, tokens = self._part(part)
        row = index - self._starts[part]
        first, last = doc_offsets[row], doc_offsets[row + 1]
        return LazyDocument(tokens, sentence_offsets[first : last + 1])


def merge_stats(stats: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for item in stats:
        for key, value in item.items():
            total[key] = total.get(key, 0) + int(value)
    return dict(sorted(total.items()))
