"""The fault texts of tests/launch/fixtures/fault_texts/ (what torch writes on a failed rank's stderr: captured
from real gloo ranks, or built from torch's NCCL format strings; its README says which), written as a rank's log."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.paths import REPO_ROOT

FAULT_TEXTS = REPO_ROOT / "tests" / "launch" / "fixtures" / "fault_texts"


def fault_text(name: str) -> str:
    """The text of fixture `name` (without .txt), its `#` header lines (how it was made) left out."""
    lines = (FAULT_TEXTS / f"{name}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("# "))


def write_rank_log(log: Path, name: str, written: float | None = None) -> Path:
    """`log` holding fixture `name` as the rank wrote it; `written`: its modification time (when the rank failed)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(fault_text(name), encoding="utf-8")
    if written is not None:
        os.utime(log, (written, written))
    return log
