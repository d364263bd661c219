"""Input files: opening (plain or bz2), the checks run before work starts, the folder listings.

Apart from the readers (data_prep/sources.py) so that those stay one screen per source; every message
names the flag and the file, since it is the one line a user sees before hours of work would start.
"""

from __future__ import annotations

import bz2
import os
from pathlib import Path
from typing import BinaryIO


class SourceError(ValueError):
    """An input file or folder is missing, unreadable, corrupt or not UTF-8; names the path."""


class DocumentTooLarge(SourceError):
    """One input document is over a cap of data_prep.config.DocumentLimits; names its file and the document."""


def open_binary(path: Path) -> BinaryIO:
    """bz2 by the file name's suffix: every source reads plain and compressed files alike."""
    return bz2.open(path, "rb") if path.suffix == ".bz2" else open(path, "rb")


def check_readable_file(path: Path, flag: str) -> None:
    """Exists, readable, decompresses (bz2), and its first MiB decodes as UTF-8."""
    if not path.is_file():
        raise SourceError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise SourceError(f"{flag} {path}: not readable (permissions)")
    try:
        with open_binary(path) as handle:
            head = handle.read(1 << 20)
    except (OSError, EOFError) as err:
        raise SourceError(f"{flag} {path}: corrupt or unreadable ({err})") from err
    try:
        # A multi-byte character may be cut at the end of the sample: tolerate only that.
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 4:
            raise SourceError(f"{flag} {path}: not UTF-8 (byte offset {err.start})") from err


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SourceError(f"{path}: not UTF-8 (byte offset {err.start})") from err


def read_text(path: Path, max_bytes: int) -> str:
    """The whole file, decoded; at most `max_bytes` are read (decompressed, for a .bz2: a 1 MiB file of one
    repeated byte decompresses to about 800 GiB), more raises DocumentTooLarge."""
    try:
        with open_binary(path) as handle:
            data = handle.read(max_bytes + 1)  # bz2 decompresses only as far as the bytes asked for
    except (OSError, EOFError) as err:
        raise SourceError(f"{path}: corrupt or unreadable ({err})") from err
    if len(data) > max_bytes:
        raise DocumentTooLarge(f"{path}: over {max_bytes:,} bytes{' decompressed' if path.suffix == '.bz2' else ''}")
    return _decode(path, data)


def list_text_files(folder: Path, flag: str, suffixes: tuple[str, ...] | None) -> list[Path]:
    """The files a folder source reads, in sorted order; `suffixes` None: every file (WikiExtractor
    names its files wiki_00 ...)."""
    if not folder.is_dir():
        raise SourceError(f"{flag} {folder}: no such folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    if suffixes is not None:
        files = [p for p in files if p.name.endswith(suffixes)]
    if not files:
        raise SourceError(f"{flag} {folder}: no text files in it")
    return files
