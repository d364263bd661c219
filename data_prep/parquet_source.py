"""The `--parquet` reader: a folder of parquet files (FineWeb, FineWeb-edu, C4 exports), one document per row of
a string column, whose row groups are the input units.

A parquet file records where each row group starts, so a large file is cut at row-group starts when the plan
is made, without reading any data, and several tasks (on several nodes) each read only their own row groups:
a 2 GB FineWeb file is not one task as a `.jsonl.gz` is. A unit is a byte range of the file, like a cut plain
file's (data_prep/byte_ranges.py): it holds the row groups that start in it. Rows are documents as `--jsonl`
lines are (the text a paragraph per line, `title` or `id` naming it), so the same rows give the same shards
from either source.

Memory: rows are read a few hundred at a time from one row group (pyarrow holds that group's column chunk
while it decompresses it); a value arrives whole from pyarrow, and one over `max_document_bytes` is left out
and counted, or stops the build, before it is copied into Python.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_prep.byte_ranges import range_name
from data_prep.config import DEFAULT_LIMITS, DocumentLimits
from data_prep.documents import PARAGRAPH_LINES, RawDocument, skip_or_raise, skipped
from data_prep.source_files import DocumentTooLarge, SourceError

ROW_GROUPS = "row-groups"  # what a parquet file is cut at (a Source row's `cut_at`)
PARQUET_SUFFIXES = (".parquet",)
_ROWS_PER_BATCH = 256
_TITLE_COLUMNS = ("title", "id")


def _open(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise SourceError(f"--parquet {path}: not a readable parquet file ({err})") from err


def check_parquet_file(path: Path, flag: str) -> None:
    """Exists, readable, and its footer (the schema and row groups) is parquet's."""
    if not path.is_file():
        raise SourceError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise SourceError(f"{flag} {path}: not readable (permissions)")
    _open(path).metadata  # noqa: B018 # reading the footer is the check


def check_text_column(path: Path, text_field: str) -> None:
    """The file has `text_field` as a string column: checked when the plan is made, before any work."""
    schema = _open(path).schema_arrow
    if text_field not in schema.names:
        raise SourceError(f"--parquet {path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                          "--parquet-text-field names the text column")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise SourceError(f"--parquet {path}: column {text_field!r} holds {kind}, not strings")


def row_group_starts(path: Path) -> list[tuple[int, int]]:
    """(byte offset, compressed bytes) of each row group, from the footer: where its first column chunk begins."""
    meta = _open(path).metadata
    starts = []
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        offsets = []
        for column in range(group.num_columns):
            chunk = group.column(column)
            offsets.append(chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset)
        size = sum(group.column(column).total_compressed_size for column in range(group.num_columns))
        starts.append((min(offsets), size))
    return starts


def row_group_cuts(path: Path, shard_bytes: int) -> list[int]:
    """Increasing row-group starts that cut the file into ranges of about `shard_bytes` (whole row groups; a
    larger row group is a range alone)."""
    cuts: list[int] = []
    filled = 0
    for offset, size in row_group_starts(path):
        if filled and filled + size > shard_bytes:
            cuts.append(offset)
            filled = 0
        filled += size
    return cuts


def read_parquet_file(path: Path, folder: Path, text_field: str, skip_bad_files: bool = False, start: int = 0,
                      end: int | None = None, limits: DocumentLimits = DEFAULT_LIMITS) -> Iterator[RawDocument]:
    """The rows of one parquet file, or of the row groups that start in a byte range of it, in order."""
    source, name = f"parquet:{path.relative_to(folder)}", range_name(path, start, end)
    where = "" if start == 0 and end is None else f" (bytes {start}-{end if end is not None else 'end'})"
    try:
        handle = _open(path)
        check_text_column(path, text_field)
        groups = [index for index, (offset, _) in enumerate(row_group_starts(path))
                  if start <= offset and (end is None or offset < end)]
        meta = handle.metadata
        first_row = sum(meta.row_group(index).num_rows for index in range(groups[0])) if groups else 0
        columns = [text_field, *(c for c in _TITLE_COLUMNS if c in handle.schema_arrow.names and c != text_field)]
        bad = 0
        row = first_row
        for batch in handle.iter_batches(batch_size=_ROWS_PER_BATCH, row_groups=groups, columns=columns):
            sizes = pc.binary_length(batch.column(text_field).cast(pa.large_binary())).to_pylist()
            titles = _titles(batch)
            cap = limits.max_document_bytes  # a batch within the cap is copied at once, else row by row
            texts = batch.column(text_field).to_pylist() if all(n is not None and n <= cap for n in sizes) else None
            for k, size in enumerate(sizes):
                title = titles[k] if titles and titles[k] else f"{name}#{row + k}"
                if size is None:
                    if not skip_bad_files:
                        raise SourceError(f"--parquet {path}: row {row + k}: {text_field!r} is null")
                    bad += 1
                elif size > limits.max_document_bytes:
                    yield skipped(source, title, DocumentTooLarge(
                        f"--parquet {path}: row {row + k}: {size:,} bytes, over the {limits.max_document_bytes:,} "
                        "a document may have"), skip_bad_files)
                else:
                    text = texts[k] if texts is not None else batch.column(text_field)[k].as_py()
                    yield RawDocument(source, title, text.replace("\r\n", "\n"), PARAGRAPH_LINES)
            row += batch.num_rows
    except (OSError, pa.ArrowException) as err:
        skip_or_raise(SourceError(f"--parquet {path}{where}: corrupt or unreadable ({err})"), skip_bad_files)
        return
    except SourceError as err:  # not parquet, or no such column: the file is left out under --skip-bad-files
        skip_or_raise(err, skip_bad_files)
        return
    if bad:
        skip_or_raise(SourceError(f"--parquet {path}{where}: {bad} row(s) with a null {text_field!r} left out"), True)


def _titles(batch: pa.RecordBatch) -> list[str | None] | None:
    for column in _TITLE_COLUMNS:
        if column in batch.schema.names:
            return [None if value is None else str(value) for value in batch.column(column).to_pylist()]
    return None
