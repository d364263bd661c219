"""The build's own errors, below every stage module so that any of them can raise one (data_prep/build.py and
data_prep/shard_tasks.py do; `python -m data_prep` prints them as one line)."""

from __future__ import annotations


class BuildError(ValueError):
    """The build cannot go on (bad input, foreign output folder, too little data); names the cause."""


class FolderComplete(Exception):
    """`merge` or `task` on a finished folder: nothing to do (its work/ files may be gone)."""
