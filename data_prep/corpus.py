"""The intermediate corpora of one input shard under OUT/work/ (paths: data_prep/work_layout.py).

    work/text/shard-NNNNN.arrow     cleaned documents: title (string), sentences (list<string>)
    work/tokens/shard-NNNNN.arrow   the tokenized documents: sentences (list<list<uint16|uint32>>)

Each file holds one record batch per chunk of `--docs-per-chunk` input documents (empty when the chunk
kept no document), so chunk k of a shard is batch k. The tokenized corpus is made once and read,
memory-mapped, by every sequence length.
"""

from __future__ import annotations

import resource
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from data_prep.batch_files import batch_row_counts, read_batches
from data_prep.shard_format.shards import id_type

TEXT_SCHEMA = pa.schema([pa.field("title", pa.string()), pa.field("sentences", pa.list_(pa.string()))])


def token_schema(vocab_size: int) -> pa.Schema:
    return pa.schema([pa.field("sentences", pa.list_(pa.list_(id_type(vocab_size))))])


def text_table(titles: list[str], sentences: list[list[str]]) -> pa.Table:
    return pa.Table.from_pydict({"title": titles, "sentences": sentences}, schema=TEXT_SCHEMA)


def token_table(
    tokens: np.ndarray, sentence_lengths: np.ndarray, doc_sentence_counts: np.ndarray, vocab_size: int
) -> pa.Table:
    """Documents as nested lists built from flat arrays (no per-token Python objects)."""
    ids = id_type(vocab_size)
    sentence_offsets = np.concatenate([[0], np.cumsum(sentence_lengths)]).astype(np.int32)
    doc_offsets = np.concatenate([[0], np.cumsum(doc_sentence_counts)]).astype(np.int32)
    sentences = pa.ListArray.from_arrays(pa.array(sentence_offsets), pa.array(tokens, type=ids))
    docs = pa.ListArray.from_arrays(pa.array(doc_offsets), sentences)
    return pa.Table.from_arrays([docs], schema=token_schema(vocab_size))


class LazyDocument(Sequence[list[int]]):
    """One tokenized document; sentences become Python lists only when asked for. The last sentence asked for
    is kept, as the same list: the instance builder reads each sentence twice in a row (its tokens, then its
    length), so that is one conversion instead of two. Read the lists, never change them."""

    def __init__(self, tokens: np.ndarray, sentence_offsets: np.ndarray) -> None:
        self._tokens = tokens
        self._offsets = sentence_offsets
        self._length = len(sentence_offsets) - 1
        self._last: tuple[int, list[int]] = (-1, [])

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += self._length
        last, sentence = self._last
        if index == last:
            return sentence
        if not 0 <= index < self._length:
            raise IndexError(index)
        sentence = self._tokens[self._offsets[index] : self._offsets[index + 1]].tolist()
        self._last = (index, sentence)
        return sentence


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


MAX_MAPPED_FILES = 1024  # token files one process keeps mapped at a time (Linux allows 65,530 maps in all)
# Open files left to everything else in the process (its libraries, pipes, the files it writes) when the mapped
# token files are capped below the open-file limit: each mapped file holds one descriptor.
FILES_KEPT_FREE = 64


def mapped_file_cap(wanted: int = MAX_MAPPED_FILES) -> int:
    """`wanted`, lowered to stay FILES_KEPT_FREE below this process's open-file limit (RLIMIT_NOFILE's soft
    value; commonly 1,024, which 1,024 mapped files would reach with the process's other files)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - FILES_KEPT_FREE))


class TokenCorpus:
    """The documents of some token files, addressed by a global document index: views of memory-mapped
    record batches, no copies. A part is one record batch (one chunk); `first_document` is the global
    index of the first file's first document (an input shard's corpus starts where the shards before end).

    Why a bound on the mapped files: in `--nsp-scope corpus` an instance worker draws random next
    segments from every document, so it reads every file, and one mapping per file would reach Linux's
    default limit of 65,530 maps (`vm.max_map_count`). So at most `max_mapped` files stay mapped, the least
    recently read unmapped first (a mapping lives on while a document read from it does). What is read is
    the same bytes either way, so no instance changes. Each mapped file also holds an open descriptor, so the
    bound is lowered below the open-file limit too (`mapped_file_cap`).
    """

    def __init__(self, paths: list[Path], first_document: int = 0, max_mapped: int = MAX_MAPPED_FILES) -> None:
        self._paths = paths
        self._max_mapped = mapped_file_cap(max(1, max_mapped))
        self._mapped: OrderedDict[int, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = OrderedDict()
        self._readers: dict[int, Any] = {}
        self._parts: list[tuple[int, int]] = []  # part -> (file, batch)
        starts = [first_document]
        for file, path in enumerate(paths):
            for batch, rows in enumerate(batch_row_counts(path)):
                self._parts.append((file, batch))
                starts.append(starts[-1] + rows)
        self._starts = starts

    def __len__(self) -> int:
        return self._starts[-1] - self._starts[0]

    @property
    def num_parts(self) -> int:
        return len(self._parts)

    def part_range(self, part: int) -> range:
        return range(self._starts[part], self._starts[part + 1])

    def _part(self, part: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        file, batch = self._parts[part]
        batches = self._mapped.get(file)
        if batches is None:
            batches = self._mapped[file] = {}
            self._readers[file] = read_batches(self._paths[file])
            while len(self._mapped) > self._max_mapped:
                evicted, _ = self._mapped.popitem(last=False)
                self._readers.pop(evicted)
        else:
            self._mapped.move_to_end(file)
        arrays = batches.get(batch)
        if arrays is None:
            arrays = batches[batch] = nested_list_arrays(self._readers[file].get_batch(batch).column(0))
        return arrays

    def document(self, index: int) -> LazyDocument:
        part = bisect_right(self._starts, index) - 1
        doc_offsets, sentence_offsets, tokens = self._part(part)
        row = index - self._starts[part]
        first, last = doc_offsets[row], doc_offsets[row + 1]
        return LazyDocument(tokens, sentence_offsets[first : last + 1])
