"""What `./launch.sh report` may read and write on a shared file system, in one place.

A run folder often sits in a folder other users can write too (a project's `runs/`, a scratch folder). The
report looks beside the run for its exports and fine-tune results (the demo lays them out as <out>/run,
<out>/model, <out>/squad), and it rewrites the exports' model cards. Anything another user made there is
untrusted: a folder whose export_info.json names our run, forged results, a card file that is a link to one of
our own files. So:

- Inside RUN_DIR everything is read (the user named that folder).
- Beside it, a folder is read only when it is this user's alone: a real folder (no link), owned by this user,
  writable by neither group nor others (`not_yours_alone`). Other folders are neither read nor entered; those
  that claim to hold an export or a result are named in the report (`claims_results`).
- Files are read without following a link in their last component and only when they are regular files
  (`read_json`: a FIFO planted under a result's name would block the report forever).
- Files are written to a temp file in the target folder, then renamed over the name (`write_file`): a rename
  replaces a link that stands under the name instead of writing through it.

Standard library only (the report's `--help` imports nothing heavy).
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from data_prep.shard_format.atomic_io import atomic_write_bytes
from pretrain.finetune.layout import RESULTS_GLOB
from pretrain.run_folder import EXPORT_INFO

JSON_LIMIT = 64 << 20  # bytes: no report input comes near (a results file, a config, a card's facts)


def not_yours_alone(folder: Path) -> str | None:
    """Why `folder` is not this user's alone (a link, another user's, writable by group or others); None when it is."""
    try:
        info = os.lstat(folder)
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return "a link or a file, not a folder"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not by you (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def claims_results(file_names: Iterable[str]) -> bool:
    """Does a folder's listing hold an export's record or a fine-tune results file (names only, nothing opened)?"""
    return any(name == EXPORT_INFO or fnmatch.fnmatch(name, RESULTS_GLOB) for name in file_names)


def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it is missing, a link, not a regular file, too large or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > JSON_LIMIT:
            return None
        try:
            return json.loads(handle.read(JSON_LIMIT + 1).decode("utf-8"))
        except (OSError, ValueError):
            return None


def write_file(path: Path, data: bytes) -> None:
    """`data` under `path`, through a temp file in its folder renamed over the name (never through a link there)."""
    atomic_write_bytes(path, data)
