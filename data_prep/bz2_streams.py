"""A multistream `.bz2` Wikipedia dump cut at its stream starts, so one 20 GB dump is many input units.

Wikimedia's `pages-articles-multistream.xml.bz2` is concatenated bz2 streams: the first holds the XML header and
`<siteinfo>`, each next one 100 whole pages, the last `</mediawiki>`. A stream can be decompressed on its own,
so a byte range of whole streams is readable without the bytes before it. The cuts are found as byte_ranges.py
finds a plain file's: from each nominal offset (k * size / pieces), forward to the next stream start (the stream
header `BZh` + level, then the first block's magic, byte-aligned there), kept only if its text begins with
`<page`: then the bytes before it are whole pages, whatever compressed them (pbzip2 cuts streams anywhere, and
such a file is simply not cut). Planning reads about one stream per cut; the index file
(`...-multistream-index.txt.bz2`) is not needed.

A range after the first lacks the dump's `<mediawiki ...>` opening tag (its namespace names every element), and
one before the last lacks `</mediawiki>`: a range is read as that tag (from the dump's first stream), its streams
decompressed, and the closing tag, so the XML reader sees a dump of just those pages.
"""

from __future__ import annotations

import bz2
import io
import re
from pathlib import Path
from typing import BinaryIO

BZ2_STREAMS = "bz2-streams"  # what a multistream dump is cut at (a Source row's `cut_at`)
_BLOCK_MAGIC = b"1AY&SY"  # 0x314159265359, the first block's header, right after `BZh` + level
_SCAN_BYTES = 1 << 20
_PAGE_PROBE = 256  # decompressed bytes looked at to tell a page start
_PROBE_INPUT = 4 << 20  # compressed bytes fed at most to see them (one block is under 1 MiB)
_CANDIDATES = 8  # stream starts tried per cut before giving up on it (a file whose streams are not pages)
_ROOT_HEAD = 1 << 16  # decompressed bytes searched for the <mediawiki ...> tag
_ROOT = re.compile(rb"<mediawiki\b[^>]*>")
_PAGE = re.compile(rb"\s*<page[\s>]")


def _stream_starts(handle: BinaryIO, offset: int, limit: int) -> list[int]:
    """Up to `_CANDIDATES` stream starts at or after `offset` and before `limit`, read 1 MiB at a time."""
    found: list[int] = []
    position = offset
    while position < limit and len(found) < _CANDIDATES:
        handle.seek(position)
        window = handle.read(_SCAN_BYTES + 9)
        if len(window) < 10:
            break
        at = window.find(b"BZh")
        while at != -1 and at < _SCAN_BYTES and len(found) < _CANDIDATES:
            if window[at + 3 : at + 4] in (b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"8", b"9") and \
                    window[at + 4 : at + 10] == _BLOCK_MAGIC and position + at < limit:
                found.append(position + at)
            at = window.find(b"BZh", at + 1)
        position += _SCAN_BYTES
    return found


def _starts_a_page(handle: BinaryIO, offset: int) -> bool:
    """The stream at `offset` decompresses (a false `BZh...` match does not) to text that begins with `<page`."""
    decompressor = bz2.BZ2Decompressor()
    handle.seek(offset)
    out, fed = b"", 0
    try:
        while len(out) < _PAGE_PROBE and fed < _PROBE_INPUT and not decompressor.eof:
            piece = handle.read(1 << 16)
            if not piece:
                break
            fed += len(piece)
            out += decompressor.decompress(piece, max_length=_PAGE_PROBE - len(out))  # stops at what it needs
    except OSError:
        return False
    return _PAGE.match(out) is not None


def stream_cuts(path: Path, size: int, pieces: int) -> list[int]:
    """Increasing stream starts, each the start of a page, that cut the dump into up to `pieces` ranges of about
    equal bytes; none when the file is one stream or its streams do not start at pages."""
    cuts: list[int] = []
    with open(path, "rb") as handle:
        for k in range(1, pieces):
            nominal = max(k * size // pieces, cuts[-1] + 1 if cuts else 1)
            for start in _stream_starts(handle, nominal, (k + 1) * size // pieces):
                if _starts_a_page(handle, start):
                    cuts.append(start)
                    break
    return cuts


class _Window(io.RawIOBase):
    """The bytes [start, end) of a file (end None: to its end)."""

    def __init__(self, path: Path, start: int, end: int | None) -> None:
        self._file = open(path, "rb")
        self._file.seek(start)
        self._left = None if end is None else end - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def] # io's buffer protocol
        view = memoryview(buffer)
        if self._left is not None:
            view = view[: self._left]
        count = self._file.readinto(view)
        if self._left is not None:
            self._left -= count
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


class _Joined(io.RawIOBase):
    """`head`, then the decompressed streams of a range, then `tail`."""

    def __init__(self, head: bytes, body: BinaryIO, tail: bytes) -> None:
        self._parts: list[BinaryIO] = [io.BytesIO(head), body, io.BytesIO(tail)]
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def] # io's buffer protocol
        while self._parts:
            count = self._parts[0].readinto(buffer)  # type: ignore[attr-defined]
            if count:
                return count
            self._parts.pop(0)
        return 0

    def close(self) -> None:
        self._body.close()
        super().close()


def root_tag(path: Path) -> bytes:
    """The dump's `<mediawiki ...>` opening tag, from the start of its first stream."""
    with bz2.open(path, "rb") as handle:
        head = handle.read(_ROOT_HEAD)
    found = _ROOT.search(head)
    if found is None:
        raise OSError(f"no <mediawiki> element in the first {_ROOT_HEAD:,} bytes")
    return found.group(0)


def open_stream_range(path: Path, start: int, end: int | None) -> BinaryIO:
    """The range's pages as a dump of their own: decompressed in bounded pieces as read."""
    head = root_tag(path) if start > 0 else b""
    body = bz2.BZ2File(_Window(path, start, end))
    return io.BufferedReader(_Joined(head, body, b"" if end is None else b"</mediawiki>\n"))  # type: ignore[arg-type]
