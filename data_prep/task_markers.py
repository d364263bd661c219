"""Completion markers (OUT/work/done/, named in data_prep/work_layout.py) that say which files they vouch for.

A task writes its files atomically, then its marker; a relaunch runs exactly the tasks without one. That
order holds across a kill, but across a machine crash a rename lives in its folder's metadata: without an
fsync of the folder, the marker (renamed later) may survive a power loss that undoes the output's rename,
or leave a file shorter than it was. So `write_marker` fsyncs each output's folder before the marker is
written, and the marker records each output's size and sha256 (under OUTPUTS_KEY, names relative to OUT).

`drop_broken_markers` runs when a build, a merge or a task starts: a marker whose outputs are missing or of
another size than it records (a truncated or removed file) is removed, with a line naming it, so that the
task runs again. It compares sizes only (one stat per file); the sha256 is there for a full check by hand
(`sha256sum`). A marker written before markers recorded their outputs has no OUTPUTS_KEY and is trusted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from data_prep.shard_format.atomic_io import atomic_write_json, fsync_folder, sha256_file
from data_prep.work_layout import done_dir

OUTPUTS_KEY = "outputs"


def write_marker(out: Path, marker: Path, record: dict[str, Any], outputs: Iterable[Path],
                 known: dict[Path, str] | None = None) -> None:
    """`record` plus the size and sha256 of each of `outputs` (files under `out`, complete), written as the
    task's marker once the outputs' folders are durable; then the marker's folder is made durable too.
    `known`: sha256 digests the task computed while writing (a shard's), so its file is not read again."""
    files = sorted(set(outputs))
    known = known or {}
    for folder in sorted({path.parent for path in files}):
        fsync_folder(folder)
    vouched = {path.relative_to(out).as_posix(): {"size": path.stat().st_size,
                                                 "sha256": known.get(path) or sha256_file(path)}
               for path in files}
    atomic_write_json(marker, {**record, OUTPUTS_KEY: vouched})
    fsync_folder(marker.parent)


def broken_output(out: Path, marker: Path) -> str | None:
    """Why `marker` does not vouch for what is on disk (an output missing or of another size), or None."""
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unreadable"
    for name, expected in (record.get(OUTPUTS_KEY) or {}).items():
        path = out / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != expected["size"]:
            return f"{name} is {size} bytes, the marker recorded {expected['size']}"
    return None


def drop_broken_markers(out: Path, markers: Iterable[Path] | None = None) -> list[Path]:
    """Remove the markers (`markers`, or every one in OUT) whose outputs do not match them (see the module
    doc); returns them."""
    dropped = []
    folder = done_dir(out)
    if markers is None:
        markers = sorted(folder.glob("*.json")) if folder.is_dir() else []
    for marker in markers:
        if not marker.is_file():
            continue
        why = broken_output(out, marker)
        if why is not None:
            print(f"{marker}: {why}; the task runs again", flush=True)
            marker.unlink(missing_ok=True)
            dropped.append(marker)
    return dropped
