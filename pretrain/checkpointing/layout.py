"""The names inside `checkpoint.dir`, in one place (checkpoint.py writes them, manifest.py and elastic.py read
them; the folder's layout is described in checkpoint.py's docstring). Standard library only.

These names are the on-disk format: renaming one makes existing checkpoints unreadable.
"""

from __future__ import annotations

import re

LATEST = "latest"  # the tag of the newest complete checkpoint
TRAINER_STATE = "trainer_state.json"
RUN_CONFIG = "run_config.json"
PHASE_END = "PHASE_END"
MANIFEST = "MANIFEST.json"
CONSOLIDATED = "elastic_state.pt"  # the world-size-free state, written by a resume on another world size
PRUNED_PREFIX = ".pruned-"  # an old tag being deleted (no tag name: never a resume candidate)
CHECKPOINT_LOCK = ".checkpoints.lock"  # flock held by the job's rank 0 (pretrain/distributed/lifetime.py)
OWNER = "run_owner.json"  # the run folder this checkpoint folder belongs to (pretrain/checkpointing/ownership.py)
TAG_PATTERN = re.compile(r"^(phase\d)-step(\d+)$")


def make_tag(phase: str, step: int) -> str:
    return f"{phase}-step{step:07d}"


def tag_order(tag: str) -> tuple[str, int]:
    """Sort key of a tag name (phase, step); ("", -1) for a name that is no tag."""
    match = TAG_PATTERN.match(tag)
    return (match.group(1), int(match.group(2))) if match else ("", -1)
