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
