"""Cutting one large plain input file into byte ranges at document boundaries, so that it can be several input
shards: read by several tasks (on several nodes), each reading only its own bytes.

A cut is always an exact document start, found at planning time by reading forward from the nominal offset
(k * size / pieces) to the next document start: a line start for one-document-per-line files (`--jsonl`), the
first non-blank line after a blank one for blank-line-separated documents (`--text`). So the ranges hold every
document once and whole, and a range's reader is a plain seek and read. Planning reads about one document per
cut; compressed files (.bz2) cannot be cut (no random access) and stay one unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from data_prep.source_files import open_binary

LINE, BLANK_LINE = "line", "blank-line"  # what separates documents in a file that can be cut


def splittable(path: Path) -> bool:
    return not path.name.endswith(".bz2")


def _line_start_at_or_after(handle, offset: int) -> int:
    """The first line start at or after `offset`."""
    if offset == 0:
        return 0
    handle.seek(offset - 1)
    if handle.read(1) == b"\n":
        return offset
    return offset + len(handle.readline())


def next_document_start(handle, offset: int, separator: str) -> int | None:
    """The first document start at or after `offset`, or None at the end of the file."""
    position = _line_start_at_or_after(handle, offset)
    handle.seek(position)
    if separator == LINE:
        while line := handle.readline():
            if line.strip():
                return position
            position += len(line)
        return None
    seen_blank = False
    while line := handle.readline():
        if not line.strip():
            seen_blank = True
        elif seen_blank:
            return position
        position += len(line)
    return None


def cut_points(path: Path, size: int, pieces: int, separator: str) -> list[int]:
    """Increasing document starts that cut the file into up to `pieces` ranges of about equal bytes."""
    cuts: list[int] = []
    with open(path, "rb") as handle:
        for k in range(1, pieces):
            start = next_document_start(handle, k * size // pieces, separator)
            if start is not None and start > (cuts[-1] if cuts else 0):
                cuts.append(start)
    return cuts


def lines_in_range(path: Path, start: int, end: int | None) -> Iterator[bytes]:
    """The lines that start in [start, end) of a plain file (start and end are line starts)."""
    with open(path, "rb") as handle:
        handle.seek(start)
        position = start
        for line in handle:
            if end is not None and position >= end:
                return
            yield line
            position += len(line)


def file_lines(path: Path, start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """The lines of a whole file (plain or .bz2), or of a byte range of a plain one."""
    if start == 0 and end is None:
        with open_binary(path) as handle:
            yield from handle
    else:
        yield from lines_in_range(path, start, end)


def range_name(path: Path, start: int = 0, end: int | None = None) -> str:
    """The file's name, marked with the range's start when it is one: what titles without one are made of."""
    return path.name if start == 0 and end is None else f"{path.name}@{start}"
