"""A real small file system for disk-full tests: a tmpfs mounted on a test's folder (CI runs as root).

`small_filesystem(folder, size)` mounts it and unmounts it when the `with` ends, whatever happened; a
machine where mounting is not permitted (not root, a container without CAP_SYS_ADMIN) skips the test with
the reason. `resize` grows or shrinks it in place (`mount -o remount`): the files stay.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


@contextmanager
def small_filesystem(folder: Path, size_kib: int) -> Iterator[Path]:
    """`folder` (created) as a tmpfs of `size_kib` KiB for the `with` block."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        mounted = _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder))
    except FileNotFoundError:
        pytest.skip("no mount command on this machine: a real full disk cannot be made")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        unmounted = subprocess.run(["umount", str(folder)], capture_output=True, text=True, timeout=60)
        if unmounted.returncode != 0:  # busy: a process of the test still holds a file there
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=60)


def resize(folder: Path, size_kib: int) -> None:
    """The tmpfs on `folder` gets `size_kib` KiB; its files stay."""
    done = _mount("-o", f"remount,size={size_kib}k", str(folder))
    assert done.returncode == 0, done.stderr


def fill(folder: Path, leave_kib: int) -> Path:
    """A file that takes all but about `leave_kib` KiB of the file system holding `folder`."""
    filler = folder / "filler.bin"
    free = shutil.disk_usage(folder).free
    with filler.open("wb") as handle:
        remaining = max(0, free - leave_kib * 1024)
        block = b"\0" * (1 << 20)
        while remaining > 0:
            remaining -= handle.write(block[: min(len(block), remaining)])
    return filler
