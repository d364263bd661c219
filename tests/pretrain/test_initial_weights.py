"""A phase's initial weights are read by one rank and broadcast (no N-rank read storm at phase 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launching import run_ranks
from tests.support.paths import SCRIPTS


@pytest.mark.multirank
def test_only_rank0_reads_and_every_rank_gets_its_weights(tmp_path: Path) -> None:
    run_ranks(SCRIPTS / "initial_weights_ranks.py", [str(tmp_path)], num_ranks=2, timeout=300)
    assert (tmp_path / "reads.txt").read_text().split() == ["0"]  # one read, by rank 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        assert result["keys"] > 20 and result["max_difference"] == 0.0
        # a read error on rank 0 reaches every rank as the same config error
        assert result["error"] == "phase1-step0000004: rank 0 could not read it"
