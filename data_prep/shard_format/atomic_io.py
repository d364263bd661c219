"""Whole-file writes that no crash or concurrent reader sees half done, and the checksum that verifies them.

Shards, manifests, checkpoint records, exports and exchange files are all written this way: to a
temporary file in the target's folder, flushed and fsynced, then renamed over the target (a rename
within one file system is atomic). Their readers verify files by sha256. It lives in the shard format
(data_prep/shard_format/), which imports nothing of pretrain/ nor of the rest of data_prep/, so both packages
(and bench/, tests/) can use this one copy.

Permissions: `mkstemp` creates its file 0600 whatever the umask, so a rename alone would make every shard,
manifest and checkpoint file private to its writer, against the sharing the docs promise (shards a team
reads, an exchange folder every job writes). The file is given `0o666 & ~umask` before its rename, what a
plain `open()` would have made; `shared_mode` gives folders (an export's staging folder) `0o777 & ~umask`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO


@cache
def process_umask() -> int:
    """This process's umask, read once. From /proc/self/status (Linux 4.7+): setting the umask to read it back
    (`os.umask`) would change it for a moment for every thread of the process, and a file another thread
    creates then gets the wrong mode. Elsewhere that round trip is the only way; the first call (import time,
    see below) is then made before the process starts threads of its own."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def give_mode(target: int | str | os.PathLike[str], mode: int) -> None:
    """chmod a descriptor or path, where the file system has modes: some network and FUSE mounts refuse chmod
    (EPERM), and a write must not fail for a courtesy; their files keep the mount's own modes."""
    try:
        os.chmod(target, mode)
    except OSError:
        pass


def shared_mode(base: int) -> int:
    """`base` (0o666 for a file, 0o777 for a folder) less this process's umask: what `open`/`mkdir` would give."""
    return base & ~process_umask()


process_umask()  # at import, while the process is likely to hold one thread


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (shards and checkpoints do not fit in memory twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_stream(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call `write(handle)` on a temp file in the same folder, fsync, then rename: readers never see a
    partial file. For writers that stream (torch.save of a large state) instead of holding the bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            give_mode(handle.fileno(), shared_mode(0o666))  # mkstemp's 0600 -> what open() would give
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def fsync_folder(path: str | os.PathLike[str]) -> None:
    """Make the folder's entries durable (files created or renamed into it): an fsync of the folder itself.

    A rename is atomic but lives in the folder's metadata; without this a power loss can undo it even
    after the file's own fsync. Checkpoint commits call it (pretrain/checkpointing/commit.py)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """`data` written atomically (see atomic_write_stream)."""
    atomic_write_stream(path, lambda handle: handle.write(data))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """`obj` as indented, key-sorted JSON (the same object always gives the same bytes), atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))
