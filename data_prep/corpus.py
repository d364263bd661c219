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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from data_prep.shards import id_type, read_table, write_shard_table

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


class TokenCorpus:
    """All token parts, memory-mapped, addressed by a global document index."""

    def __init__(self, paths: list[Path]) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        starts = [0]
        for path in paths:
            column = read_table(path).column("sentences").combine_chunks()
            doc_offsets = column.offsets.to_numpy()
            sentences = column.values
            sentence_offsets = sentences.offsets.to_numpy()
            tokens = sentences.values.to_numpy(zero_copy_only=False)
            self._parts.append((doc_offsets, sentence_offsets, tokens))
            starts.append(starts[-1] + len(column))
        self._starts = starts

    def __len__(self) -> int:
        return self._starts[-1]

    def part_range(self, part: int) -> range:
        return range(self._starts[part], self._starts[part + 1])

    def document(self, index: int) -> LazyDocument:
        part = bisect_right(self._starts, index) - 1
        doc_offsets, sentence_offsets, tokens = self._parts[part]
        row = index - self._starts[part]
        first, last = doc_offsets[row], doc_offsets[row + 1]
        return LazyDocument(tokens, sentence_offsets[first : last + 1])


def merge_stats(stats: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for item in stats:
        for key, value in item.items():
            total[key] = total.get(key, 0) + int(value)
    return dict(sorted(total.items()))
