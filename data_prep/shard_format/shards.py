"""THE on-disk shard format, its manifest, and its reader. Defined here once.

Layout of an output folder ``OUT``::

    OUT/manifest.json              written last, atomically: only complete shards are ever listed
    OUT/vocab.txt                  the WordPiece vocab the ids refer to (sha256 in the manifest)
    OUT/tokenizer.json             the `tokenizers` object that made the ids (vocab + normalisation), and
    OUT/tokenizer_probe.json       a few hundred corpus sentences with their ids (data_prep/shard_format/tokenizer_probe.py)
    OUT/seq128/train-00000.arrow   Apache Arrow IPC *file* format, one record batch per shard
    OUT/seq128/val-00000.arrow
    OUT/seq512/...

Columns of every shard (readable with plain ``pyarrow.ipc.open_file``):

    input_ids            list<uint16>  (list<uint32> when the vocab has >= 65536 entries)
                         ``[CLS] A [SEP] B [SEP]``, unpadded; ``[CLS] sentences [SEP]`` in the
                         packed modes (a [SEP] also between two documents' sentences in
                         ``full-sentences``). With static masking the masked tokens are already
                         replaced ([MASK] / random / kept).
    a_len                uint16        tokens of ``[CLS] A [SEP]``; token_type_ids are
                         ``[0] * a_len + [1] * (len(input_ids) - a_len)``. Packed modes: the
                         whole instance (``len(input_ids)``), so the token types are all 0.
    next_sentence_label  int8          0 = B really follows A, 1 = B is a random segment
                                       (the ``BertForPreTraining`` convention);
                                       NO_NEXT_SENTENCE_LABEL (-1) = none: the packed modes
                                       (MLM only). The column is always there, so one schema
                                       and one reader serve every mode.
    masked_positions     list<uint16>  static masking only: positions that carry an MLM label
    masked_label_ids     list<uint16|uint32>  static masking only: the original ids there

The manifest (``manifest.json``)::

    {"format": "bert-ds-shards", "format_version": 1, "tool_version": "...",
     "vocab": {"file": "vocab.txt", "sha256": "...", "size": 30522, "lowercase": true},
     "masking": {"mode": "dynamic"|"static", "mask_prob": 0.15, "whole_word": false,
                 "dupe_factor": 1, "max_predictions": {"128": 20, "512": 80}},
     "segments": "nsp"|"full-sentences"|"doc-sentences",
     "tokenizer": {"file": "tokenizer.json", "sha256": "...", "probe": "tokenizer_probe.json",
                   "probe_sha256": "...", "probe_sentences": 256},
     "seed": 12345, "config": {... the full build config ...},
     "totals": {"documents": ..., "sentences": ..., "tokens": ..., ...},
     "seq_lens": {"128": {"train": {"num_instances": N, "nsp_random_fraction": 0.5,
                                    "shards": [{"file": "seq128/train-00000.arrow",
                                                "num_instances": n, "sha256": "..."}]},
                          "val": {...}},
                  "512": {...}}}

``segments`` says how instances were built (data_prep/instances.py): ``nsp`` = BERT's pairs, trained
with MLM + NSP; ``full-sentences`` / ``doc-sentences`` = RoBERTa's packed single segments, MLM only,
``nsp_random_fraction`` null. A manifest without the key predates the packed modes and is ``nsp``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from data_prep.shard_format.atomic_io import atomic_write_stream, sha256_file
from data_prep.shard_format.modes import NSP, SEGMENT_MODES

FORMAT_NAME = "bert-ds-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")
NO_NEXT_SENTENCE_LABEL = -1  # `next_sentence_label` of an instance that has none (packed modes)


class ShardFormatError(ValueError):
    """A shard folder, manifest or shard file does not match the format above."""


def id_type(vocab_size: int) -> pa.DataType:
    """uint16 ids whenever the vocab fits: half the bytes of int32 on disk and in page cache."""
    return pa.uint16() if vocab_size <= 65536 else pa.uint32()


def shard_schema(vocab_size: int, static_masking: bool) -> pa.Schema:
    ids = pa.list_(id_type(vocab_size))
    fields = [
        pa.field("input_ids", ids, nullable=False),
        pa.field("a_len", pa.uint16(), nullable=False),
        pa.field("next_sentence_label", pa.int8(), nullable=False),
    ]
    if static_masking:
        fields += [
            pa.field("masked_positions", pa.list_(pa.uint16()), nullable=False),
            pa.field("masked_label_ids", ids, nullable=False),
        ]
    return pa.schema(fields)


def write_shard(
    path: str | os.PathLike[str],
    rows: Sequence[dict[str, Any]],
    vocab_size: int,
    static_masking: bool,
) -> tuple[int, str]:
    """Write ``rows`` (dicts with the columns above) as one Arrow IPC file, atomically.

    Returns (number of instances, sha256 of the file). The bytes depend only on ``rows``,
    so the same instances always give the same file.
    """
    schema = shard_schema(vocab_size, static_masking)
    columns = {name: [row[name] for row in rows] for name in schema.names}
    return write_shard_table(path, pa.Table.from_pydict(columns, schema=schema))


def write_shard_table(path: str | os.PathLike[str], table: pa.Table) -> tuple[int, str]:
    """Write a table with the shard schema as one record batch, atomically; (rows, sha256).

    One batch whatever the table's chunking, so the bytes depend only on the rows.
    The file is streamed into its temp file and hashed on the way: no copy of its bytes in memory
    (an in-memory buffer and its bytes object were two more copies of every shard).
    """
    table = table.combine_chunks()
    sink = _HashingSink()

    def write(handle: BinaryIO) -> None:
        sink.handle = handle
        with ipc.new_file(pa.PythonFile(sink, mode="w"), table.schema) as writer:
            writer.write_table(table, max_chunksize=max(1, table.num_rows))

    atomic_write_stream(path, write)
    return table.num_rows, sink.digest.hexdigest()


class _HashingSink:
    """A binary file object that hashes what passes to the real file (set as `handle` once open).
    Closing it leaves the file open: atomic_write_stream fsyncs and renames it afterwards."""

    def __init__(self) -> None:
        self.handle: BinaryIO | None = None
        self.digest = hashlib.sha256()
        self.closed = False

    def write(self, data: bytes | memoryview) -> int:
        assert self.handle is not None
        self.digest.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def read_table(path: str | os.PathLike[str]) -> pa.Table:
    """A whole Arrow IPC file, memory-mapped (no copy until a column is touched)."""
    try:
        return ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except (OSError, pa.ArrowInvalid) as err:
        raise ShardFormatError(f"{path}: not a readable Arrow IPC file: {err}") from err


def _file_entries(data: dict[str, Any]) -> list[Any]:
    """Every file a manifest names: the vocab, the tokenizer files, each shard."""
    entries = [data["vocab"].get("file") if isinstance(data["vocab"], dict) else data["vocab"]]
    tokenizer = data.get("tokenizer")
    if isinstance(tokenizer, dict):
        entries += [tokenizer.get("file"), tokenizer.get("probe")]
    for by_split in data["seq_lens"].values() if isinstance(data["seq_lens"], dict) else ():
        for entry in by_split.values() if isinstance(by_split, dict) else ():
            entries += [shard.get("file") for shard in entry.get("shards", ()) if isinstance(shard, dict)]
    return [entry for entry in entries if entry is not None]  # a missing one is another error, found where read


def _stays_inside(entry: Any) -> bool:
    """A relative path without `..`: what the build writes. Checked on the words, not by resolving links, so a
    folder the owner links in still reads; an entry that climbs out of the root or starts at `/` never does."""
    if not isinstance(entry, str) or not entry or "\0" in entry:
        return False
    return not os.path.isabs(entry) and ".." not in Path(entry).parts


@dataclass(frozen=True)
class ShardInfo:
    file: str
    num_instances: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict[str, Any]

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> Manifest:
        root = Path(root)
        path = root / MANIFEST_NAME
        if not path.is_file():
            raise ShardFormatError(f"{path}: no manifest; build shards with `python -m data_prep build --out {root}`")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ShardFormatError(f"{path}: unreadable manifest: {err}") from err
        if data.get("format") != FORMAT_NAME or data.get("format_version") != FORMAT_VERSION:
            raise ShardFormatError(
                f"{path}: format {data.get('format')!r} v{data.get('format_version')!r}, "
                f"expected {FORMAT_NAME!r} v{FORMAT_VERSION}"
            )
        for key in ("vocab", "masking", "seq_lens"):
            if key not in data:
                raise ShardFormatError(f"{path}: missing field {key!r}")
        if data.get("segments", NSP) not in SEGMENT_MODES:
            raise ShardFormatError(f"{path}: segments {data['segments']!r}, expected one of {', '.join(SEGMENT_MODES)}")
        for entry in _file_entries(data):
            if not _stays_inside(entry):
                raise ShardFormatError(f"{path}: file entry {entry!r} is not a path inside {root}")
        return cls(root=root, data=data)

    @property
    def vocab_size(self) -> int:
        return int(self.data["vocab"]["size"])

    @property
    def vocab_sha256(self) -> str:
        return str(self.data["vocab"]["sha256"])

    @property
    def vocab_path(self) -> Path:
        return self.root / self.data["vocab"]["file"]

    @property
    def tokenizer_path(self) -> Path | None:
        """tokenizer.json, the tokenizer that made the ids; None for shards built before it was written."""
        entry = self.data.get("tokenizer")
        return self.root / entry["file"] if entry else None

    @property
    def probe_path(self) -> Path | None:
        """tokenizer_probe.json, sentences and their ids (data_prep/shard_format/tokenizer_probe.py); None before it existed."""
        entry = self.data.get("tokenizer")
        return self.root / entry["probe"] if entry else None

    @property
    def static_masking(self) -> bool:
        return self.data["masking"]["mode"] == "static"

    @property
    def segments(self) -> str:
        """How the instances were built: "nsp" (also for manifests older than the key), or an MLM-only
        packed mode, "full-sentences" or "doc-sentences"."""
        return str(self.data.get("segments", NSP))

    @property
    def next_sentence_labels(self) -> bool:
        """Whether the shards' instances carry a next-sentence label (0/1) to train NSP on."""
        return self.segments == NSP

    @property
    def seq_lens(self) -> list[int]:
        return sorted(int(s) for s in self.data["seq_lens"])

    def shards(self, seq_len: int, split: str = "train") -> list[ShardInfo]:
        by_len = self.data["seq_lens"].get(str(seq_len))
        if by_len is None:
            raise ShardFormatError(
                f"{self.root / MANIFEST_NAME}: no shards for sequence length {seq_len}; "
                f"it has {self.seq_lens}"
            )
        entry = by_len.get(split)
        if entry is None:
            raise ShardFormatError(f"{self.root / MANIFEST_NAME}: no {split!r} split at sequence length {seq_len}")
        return [ShardInfo(s["file"], int(s["num_instances"]), s["sha256"]) for s in entry["shards"]]

    def verify(self, seq_len: int, split: str = "train", checksums: bool = True) -> None:
        """Every listed shard exists, has the listed count and (optionally) the listed sha256."""
        for info in self.shards(seq_len, split):
            path = self.root / info.file
            if not path.is_file():
                raise ShardFormatError(f"{path}: listed in the manifest but missing")
            if checksums and sha256_file(path) != info.sha256:
                raise ShardFormatError(f"{path}: sha256 differs from the manifest (corrupt or replaced)")


class ShardReader:
    """Random access to the instances of one (sequence length, split), memory-mapped.

    ``reader[i]`` returns numpy arrays; nothing is decoded up front, so opening hundreds of
    shards costs only their Arrow footers.
    """

    def __init__(self, manifest: Manifest, seq_len: int, split: str = "train") -> None:
        self.manifest = manifest
        self.seq_len = seq_len
        self.split = split
        self.infos = manifest.shards(seq_len, split)
        self._tables: list[pa.Table | None] = [None] * len(self.infos)
        counts = np.array([info.num_instances for info in self.infos], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def shard_table(self, shard_index: int) -> pa.Table:
        table = self._tables[shard_index]
        if table is None:
            path = self.manifest.root / self.infos[shard_index].file
            try:
                table = ipc.open_file(pa.memory_map(str(path), "r")).read_all()
            except (OSError, pa.ArrowInvalid) as err:
                raise ShardFormatError(f"{path}: not a readable Arrow IPC shard: {err}") from err
            if table.num_rows != self.infos[shard_index].num_instances:
                raise ShardFormatError(
                    f"{path}: {table.num_rows} rows, manifest says {self.infos[shard_index].num_instances}"
                )
            self._tables[shard_index] = table
        return table

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"instance {index} out of range 0..{len(self) - 1}")
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return shard, index - int(self.offsets[shard])

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard, row = self.locate(index)
        table = self.shard_table(shard)
        out: dict[str, Any] = {}
        for name in table.column_names:
            value = table.column(name)[row]
            if isinstance(value, pa.ListScalar):
                out[name] = value.values.to_numpy(zero_copy_only=False).astype(np.int64)
            else:
                out[name] = int(value.as_py())
        return out

