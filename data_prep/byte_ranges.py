"""Cutting one large plain input file into byte ranges at document boundaries, so that it can be several input
shards: read by several tasks (on several nodes), each reading only its own bytes.

A cut is always an exact document start, found at planning time by reading forward from the nominal offset
(k * size / pieces) to the next document start: a line start for one-document-per-line files (`--jsonl`), the
first non-blank line after a blank one for blank-line-separated documents (`--text`). So the ranges hold every
document once and whole, and a range's reader is a plain seek and read. Planning reads about one document per
cut; compressed files (.bz2, .gz, .zst) cannot be cut (no random access) and stay one unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from data_prep.source_files import compressed, open_binary

LINE, BLANK_LINE = "line", "blank-line"  # what separates documents in a file that can be cut
_DISCARD_BYTES = 1 << 20  # how much of a line is held at a time where only its length matters


def splittable(path: Path) -> bool:
    return not compressed(path)


def _next_line(handle: BinaryIO) -> tuple[int, bool] | None:
    """The next line's length and whether it is blank (whitespace only), read at most 1 MiB at a time (a line
    may be gigabytes long); None at the end of the file."""
    size, blank = 0, True
    while piece := handle.readline(_DISCARD_BYTES):
        size += len(piece)
        blank = blank and not piece.strip()
        if piece.endswith(b"\n"):
            break
    return (size, blank) if size else None


def _line_start_at_or_after(handle: BinaryIO, offset: int) -> int:
    """The first line start at or after `offset`."""
    if offset == 0:
        return 0
    handle.seek(offset - 1)
    if handle.read(1) == b"\n":
        return offset
    rest = _next_line(handle)
    return offset + (rest[0] if rest else 0)


def next_document_start(handle: BinaryIO, offset: int, separator: str) -> int | None:
    """The first document start at or after `offset`, or None at the end of the file."""
    position = _line_start_at_or_after(handle, offset)
    handle.seek(position)
    seen_blank = False
    while line := _next_line(handle):
        size, blank = line
        if separator == LINE and not blank:
            return position
        if separator != LINE:
            if blank:
                seen_blank = True
            elif seen_blank:
                return position
        position += size
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


@dataclass(frozen=True)
class LongLine:
    """A line over the caller's limit, in place of its bytes: only its length was kept while it was read."""

    size: int


def _bounded_lines(handle: BinaryIO, limit: int | None) -> Iterator[bytes | LongLine]:
    """The lines of `handle`; with a limit, each read is at most limit + 1 bytes, and a longer line is passed
    over in pieces and given as LongLine (one JSON line of 128 MiB used to cost 706 MiB while it was read)."""
    if limit is None:
        yield from handle
        return
    while line := handle.readline(limit + 1):
        if len(line) <= limit:
            yield line
            continue
        size = len(line)
        while not line.endswith(b"\n") and (line := handle.readline(_DISCARD_BYTES)):
            size += len(line)
        yield LongLine(size)


def lines_in_range(path: Path, start: int, end: int | None, limit: int | None = None) -> Iterator[bytes | LongLine]:
    """The lines that start in [start, end) of a plain file (start and end are line starts)."""
    with open(path, "rb") as handle:
        handle.seek(start)
        position = start
        for line in _bounded_lines(handle, limit):
            if end is not None and position >= end:
                return
            yield line
            position += line.size if isinstance(line, LongLine) else len(line)


def file_lines(path: Path, start: int = 0, end: int | None = None,
               limit: int | None = None) -> Iterator[bytes | LongLine]:
    """The lines of a whole file (plain or compressed), or of a byte range of a plain one; with `limit`, a line over
    that many bytes (its newline included) is never held whole: it comes as LongLine."""
    if start == 0 and end is None:
        with open_binary(path) as handle:
            yield from _bounded_lines(handle, limit)
    else:
        yield from lines_in_range(path, start, end, limit)


def range_name(path: Path, start: int = 0, end: int | None = None) -> str:
    """The file's name, marked with the range's start when it is one: what titles without one are made of."""
    return path.name if start == 0 and end is None else f"{path.name}@{start}"
