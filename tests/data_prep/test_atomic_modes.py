"""Atomic writes honour the umask: `mkstemp` makes its file 0600, and a rename alone would keep that, so shards,
manifests and checkpoint files shared with a team (or an exchange folder every job writes) were private to
their writer. A file written atomically gets what `open()` would give it: 0o666 less the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from data_prep.shard_format.atomic_io import atomic_write_bytes, atomic_write_json, process_umask, shared_mode


@pytest.fixture
def umask() -> Iterator[None]:
    saved = os.umask(0o022)
    os.umask(saved)
    yield
    os.umask(saved)
    process_umask.cache_clear()


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_take_the_mode_open_would_give(tmp_path: Path, umask: None, mask: int, expected: int) -> None:
    os.umask(mask)
    process_umask.cache_clear()  # read once per process: a new umask is a new process here
    atomic_write_bytes(tmp_path / "shard.bin", b"x")
    atomic_write_json(tmp_path / "manifest.json", {"a": 1})
    with open(tmp_path / "plain.txt", "w") as handle:  # the reference: what a plain write gets
        handle.write("x")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"shard.bin": expected, "manifest.json": expected, "plain.txt": expected}
    assert shared_mode(0o777) == 0o777 & ~mask
