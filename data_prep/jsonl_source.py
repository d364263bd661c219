"""The `--jsonl` reader: JSON-lines files (plain or compressed, C4's `*.json.gz` too), one document per line,
streamed in bounded memory (a line over the cap on one document is passed over, never held)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from data_prep.byte_ranges import LongLine, file_lines, range_name
from data_prep.config import DEFAULT_LIMITS, DocumentLimits
from data_prep.documents import PARAGRAPH_LINES, RawDocument, skip_or_raise, skipped
from data_prep.source_files import DocumentTooLarge, SourceError, list_text_files, with_compression

JSONL_SUFFIXES = with_compression((".jsonl", ".json"))  # C4 ships *.json.gz


def read_jsonl(folder: Path, skip_bad_files: bool = False,
               limits: DocumentLimits = DEFAULT_LIMITS) -> Iterator[RawDocument]:
    """Every JSON-lines file under `folder` (JSONL_SUFFIXES, sorted paths), one document per line: an object whose string
    `text` field holds the document, one paragraph per line (as `--hf-dataset` rows, so the same rows
    give the same shards either way); its `title` or `id` names it. Streamed, without `datasets`.

    A bad line (not UTF-8, not JSON, no string `text`) stops the build naming the file and line; under
    --skip-bad-files it is skipped, and each file's skipped lines are counted in one warning. A line over
    `max_document_bytes` is never held whole: it stops the build, or is skipped and counted as a document.
    """
    for path in list_text_files(folder, "--jsonl", JSONL_SUFFIXES):
        yield from read_jsonl_file(path, folder, skip_bad_files, limits=limits)


def read_jsonl_file(path: Path, folder: Path, skip_bad_files: bool = False, start: int = 0,
                    end: int | None = None, limits: DocumentLimits = DEFAULT_LIMITS) -> Iterator[RawDocument]:
    """One JSON-lines file, or the lines that start in a byte range of it (cut at line starts)."""
    source, name = f"jsonl:{path.relative_to(folder)}", range_name(path, start, end)
    bad: list[str] = []
    try:
        for number, raw in enumerate(file_lines(path, start, end, limits.max_document_bytes), start=1):
            if isinstance(raw, LongLine):
                yield skipped(source, f"{name}#{number}", DocumentTooLarge(
                    f"--jsonl {path}: line {number}{'' if start == 0 else f' from byte {start}'}: {raw.size:,} "
                    f"bytes, over the {limits.max_document_bytes:,} a document may have"), skip_bad_files)
                continue
            if not raw.strip():
                continue
            try:
                yield _jsonl_document(raw, source, f"{name}#{number}")
            except SourceError as err:
                if not skip_bad_files:
                    raise SourceError(f"--jsonl {path}: line {number}{'' if start == 0 else f' from byte {start}'}: "
                                      f"{err}") from err
                bad.append(f"line {number}: {err}")
    except (OSError, EOFError) as err:
        skip_or_raise(SourceError(f"--jsonl {path}: corrupt or unreadable ({err})"), skip_bad_files)
    if bad:
        skip_or_raise(SourceError(f"--jsonl {path}: {len(bad)} bad line(s) left out (first: {bad[0]})"), True)


def _jsonl_document(raw: bytes, source: str, fallback_title: str) -> RawDocument:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise SourceError(f"not UTF-8 (byte offset {err.start})") from err
    except json.JSONDecodeError as err:
        raise SourceError(f"not JSON ({err.msg}, column {err.colno})") from err
    text = row.get("text") if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise SourceError('not an object with a string "text" field')
    title = row.get("title") or row.get("id") or fallback_title
    return RawDocument(source, str(title), text.replace("\r\n", "\n"), PARAGRAPH_LINES)
