"""Shared fixtures: where ../shared/data is, and a runner for multi-rank DeepSpeed jobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT


def shared_data_dir() -> Path | None:
    """The real sample data: $BERT_DS_SHARED_DATA, else ../shared/data beside the checkout."""
    configured = os.environ.get("BERT_DS_SHARED_DATA")
    path = Path(configured) if configured else REPO_ROOT.parent / "shared" / "data"
    return path if path.is_dir() else None


@pytest.fixture
def shared_data() -> Path:
    path = shared_data_dir()
    if path is None:
        pytest.skip("../shared/data is absent (set BERT_DS_SHARED_DATA to a folder laid out like it)")
    return path


def checkout_changes() -> set[str] | None:
    """`git status` of the checkout (ignored paths left out), or None outside a git checkout."""
    import subprocess

    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(status.stdout.splitlines()) if status.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[CHECKOUT_BEFORE] = checkout_changes()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests write only to temporary folders: a file the suite left in the checkout fails the run, named.

    (A batch script once wrote its requeue note into the checkout's root, and it was committed.)"""
    before, after = session.stash.get(CHECKOUT_BEFORE, None), checkout_changes()
    if before is None or after is None or not (left := sorted(after - before)):
        return
    session.config.get_terminal_writer().line("")
    session.config.get_terminal_writer().line(
        "the tests changed the checkout (tests write only to temporary folders): " + ", ".join(left), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


CHECKOUT_BEFORE = pytest.StashKey[set[str] | None]()
