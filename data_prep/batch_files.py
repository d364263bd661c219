"""Arrow IPC files of many record batches, written as they come: the work files of one input shard.

A task over an input shard writes one file per output (its cleaned text, its tokens, its instances at one
length and split), a record batch per chunk of documents or per batch of instances, so that it holds one
batch at a time and never the shard. The file appears by atomic rename once its last batch is written, as
every file of the build does (data_prep/shard_format/atomic_io.py): a killed task leaves only a temp file, which the
relaunch removes.
"""

from __future__ import annotations

import errno
import os
import resource
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from data_prep.shard_format.shards import ShardFormatError


class AtomicBatchWriter:
    """`with AtomicBatchWriter(path, schema) as writer: writer.write(table)`: the file exists, whole, only
    after a clean exit; on an exception the temp file is removed. `write` appends a table's rows as
    record batches (an empty table as one empty batch, so that batch k is always chunk k)."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self.rows = 0

    def __enter__(self) -> AtomicBatchWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._handle = os.fdopen(fd, "wb")
        self._writer = ipc.new_file(pa.PythonFile(self._handle, mode="w"), self.schema)
        return self

    def write(self, table: pa.Table) -> None:
        table = table.cast(self.schema) if table.schema != self.schema else table
        if table.num_rows == 0:
            self._writer.write_batch(pa.RecordBatch.from_pylist([], schema=self.schema))
        else:
            self._writer.write_table(table.combine_chunks(), max_chunksize=table.num_rows)
        self.rows += table.num_rows

    def __exit__(self, kind: object, *_: object) -> None:
        try:
            if kind is None:
                self._writer.close()
                self._handle.flush()
                os.fsync(self._handle.fileno())
            self._handle.close()
            if kind is None:
                os.replace(self._tmp, self.path)
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)


def _unreadable(path: Path, err: Exception) -> ShardFormatError:
    """The error for a file that could not be opened or read: a full open-file table is named as such (with the
    limit and what to do), not taken for a bad file."""
    if getattr(err, "errno", None) == errno.EMFILE or "Too many open files" in str(err):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return ShardFormatError(
            f"{path}: cannot open: this process has reached its open-file limit (RLIMIT_NOFILE {soft}, hard "
            f"{hard}); each mapped token file holds one (--nsp-scope corpus maps up to that limit less 64): "
            "raise it (`ulimit -n`) or use fewer, larger input shards")
    return ShardFormatError(f"{path}: not a readable Arrow IPC file: {err}")


def batch_row_counts(path: Path) -> list[int]:
    """Rows of each record batch, from the batch headers; the file is unmapped on return."""
    try:
        source = pa.memory_map(str(path), "r")
    except OSError as err:
        raise _unreadable(path, err) from err
    try:
        reader = ipc.open_file(source)
        return [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
    except (OSError, pa.ArrowInvalid) as err:
        raise _unreadable(path, err) from err
    finally:
        source.close()


def read_batches(path: Path) -> ipc.RecordBatchFileReader:
    """A memory-mapped reader: `get_batch(k)` is chunk k, no copy."""
    try:
        return ipc.open_file(pa.memory_map(str(path), "r"))
    except (OSError, pa.ArrowInvalid) as err:
        raise _unreadable(path, err) from err
