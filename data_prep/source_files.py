"""Input files: opening (plain, bz2, gzip or zstd, by suffix), the checks run before work starts, the folder
listings, which name every file they leave out.

Apart from the readers (data_prep/sources.py) so that those stay one screen per source; every message
names the flag and the file, since it is the one line a user sees before hours of work would start.
"""

from __future__ import annotations

import bz2
import gzip
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# A compressed file is read from its start only (no random access), so it is one input unit whatever its size.
COMPRESSED_SUFFIXES = (".bz2", ".gz", ".zst")


class SourceError(ValueError):
    """An input file or folder is missing, unreadable, corrupt or not UTF-8; names the path."""


class DocumentTooLarge(SourceError):
    """One input document is over a cap of data_prep.config.DocumentLimits; names its file and the document."""


def compressed(path: Path) -> bool:
    return path.name.endswith(COMPRESSED_SUFFIXES)


def with_compression(suffixes: tuple[str, ...]) -> tuple[str, ...]:
    """Each plain suffix and its compressed forms: `.txt` -> `.txt`, `.txt.bz2`, `.txt.gz`, `.txt.zst`."""
    return tuple(plain + packed for plain in suffixes for packed in ("", *COMPRESSED_SUFFIXES))


class _ZstdFile(io.RawIOBase):
    """A zstd file's decompressed bytes (every frame), its decoder's errors raised as OSError like gzip's and
    bz2's, so that every reader's one `except (OSError, EOFError)` names a corrupt file of any kind."""

    def __init__(self, path: Path) -> None:
        try:
            import zstandard  # imported here: only .zst inputs need it
        except ImportError as err:
            raise OSError("reading .zst files needs the zstandard package (pip install zstandard)") from err
        self._error = zstandard.ZstdError
        self._file = open(path, "rb")
        self._reader = zstandard.ZstdDecompressor().stream_reader(self._file, read_across_frames=True)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def] # io's buffer protocol
        try:
            count = self._reader.readinto(buffer)
        except self._error as err:
            raise OSError(f"zstd: {err}") from err
        if count == 0 and len(buffer):
            _check_zstd_frames(self._file)  # the decoder ends a cut-off frame without a word
        return count

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
            self._file.close()
        super().close()


_ZSTD_MAGIC = 0xFD2FB528


def _check_zstd_frames(handle: BinaryIO) -> None:
    """The file is whole zstd frames (RFC 8878), walked by their block headers without decompressing: a file cut
    off mid-frame raises OSError. python-zstandard's reader returns a truncated file's bytes as if complete."""
    size = os.fstat(handle.fileno()).st_size
    position = 0
    while position < size:
        handle.seek(position)
        head = handle.read(14)
        magic = int.from_bytes(head[:4], "little")
        if len(head) >= 8 and magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame: its size follows
            position += 8 + int.from_bytes(head[4:8], "little")
            continue
        if len(head) < 5 or magic != _ZSTD_MAGIC:
            raise OSError(f"zstd: no frame at byte {position:,} (cut off or not zstd)")
        descriptor = head[4]
        single = bool(descriptor & 0x20)
        size_field = (1 if single else 0, 2, 4, 8)[descriptor >> 6]
        position += 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3] + size_field
        last = False
        while not last:
            handle.seek(position)
            block = handle.read(3)
            if len(block) < 3:
                raise OSError(f"zstd: cut off inside a frame (file ends at byte {size:,})")
            header = int.from_bytes(block, "little")
            last, kind, length = bool(header & 1), (header >> 1) & 3, header >> 3
            position += 3 + (1 if kind == 1 else length)
        position += 4 if descriptor & 0x04 else 0  # the content checksum
    if position != size:
        raise OSError(f"zstd: cut off inside a frame (file ends at byte {size:,})")


def open_binary(path: Path) -> BinaryIO:
    """Decompressed by the file name's suffix (.bz2, .gz, .zst): every source reads plain and compressed files
    alike. Each decompresses only as far as the bytes asked for, so the readers' bounded reads bound it too."""
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    if path.suffix == ".gz":
        # gzip's own line reading buffers 8 KiB at a time: a 1 MiB buffer reads JSON lines about 20 % faster
        return io.BufferedReader(gzip.GzipFile(path, "rb"), buffer_size=1 << 20)  # type: ignore[arg-type]
    if path.suffix == ".zst":
        return io.BufferedReader(_ZstdFile(path), buffer_size=1 << 20)
    return open(path, "rb")


def check_readable_file(path: Path, flag: str) -> None:
    """Exists, readable, decompresses (by its suffix), and its first MiB decodes as UTF-8."""
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
    """The whole file, decoded; at most `max_bytes` are read (decompressed, for a compressed file: a 1 MiB .bz2 of
    one repeated byte decompresses to about 800 GiB, a 1 MiB .gz to 1 GiB), more raises DocumentTooLarge."""
    try:
        with open_binary(path) as handle:
            data = handle.read(max_bytes + 1)  # decompressed only as far as the bytes asked for
    except (OSError, EOFError) as err:
        raise SourceError(f"{path}: corrupt or unreadable ({err})") from err
    if len(data) > max_bytes:
        raise DocumentTooLarge(f"{path}: over {max_bytes:,} bytes{' decompressed' if compressed(path) else ''}")
    return _decode(path, data)


@dataclass(frozen=True)
class FolderListing:
    """A folder source's files: those it reads (sorted) and those it leaves out (other suffixes), by name.
    Hidden files (names starting with '.', such as a sync tool's or Hadoop's `.crc` files) are not inputs."""

    files: tuple[Path, ...]
    others: tuple[Path, ...]


def list_folder(folder: Path, flag: str, suffixes: tuple[str, ...] | None) -> FolderListing:
    """The files a folder source reads, in sorted order, and the files it does not; `suffixes` None: every file
    (WikiExtractor names its files wiki_00 ...). A folder with nothing to read is an error."""
    if not folder.is_dir():
        raise SourceError(f"{flag} {folder}: no such folder")
    every = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    files = [p for p in every if suffixes is None or p.name.endswith(suffixes)]
    read = set(files)
    if not files:
        raise SourceError(f"{flag} {folder}: no text files in it"
                          + (f" (read: {', '.join(f'*{s}' for s in suffixes)})" if suffixes else ""))
    return FolderListing(tuple(files), tuple(p for p in every if p not in read))


def list_text_files(folder: Path, flag: str, suffixes: tuple[str, ...] | None) -> list[Path]:
    """The files a folder source reads, in sorted order (those it leaves out: `check_folder`)."""
    return list(list_folder(folder, flag, suffixes).files)


def check_folder(folder: Path, flag: str, suffixes: tuple[str, ...] | None, skip_bad_files: bool) -> list[Path]:
    """The folder's files; a file it would leave out (another suffix: a `.jsonl.gz` beside `.jsonl` files once
    was, losing its documents without a word) stops the build naming every such file, or under --skip-bad-files
    is named in one warning with their count."""
    listing = list_folder(folder, flag, suffixes)
    if listing.others:
        names = ", ".join(str(p.relative_to(folder)) for p in listing.others)
        expected = ", ".join(f"*{s}" for s in suffixes or ())
        message = f"{flag} {folder}: {len(listing.others)} file(s) of no known kind (read: {expected}): {names}"
        if not skip_bad_files:
            raise SourceError(message + "; remove them, or pass --skip-bad-files to leave them out")
        print(f"warning: skipped (--skip-bad-files): {message}", file=sys.stderr, flush=True)
    return list(listing.files)
