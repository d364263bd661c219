"""The run's goodput from its clock: productive step time over wall time, counted by hand on three processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.launch.faults import FaultHistory, FaultRecord
from pretrain.metrics.clock import ProcessSpan, downtime, last_fault_time, redone_steps, run_goodput
from pretrain.run_folder import faults_dir


def test_goodput_counts_redone_steps_and_fault_downtime_against_the_run() -> None:
    """A: steps 1-10 at 2 s, killed by a fault after a checkpoint at step 6; B: restarted by the agent 30 s after A's
    last write, redoes 7-10 and goes on to 14 at 2 s; then a stop the user asked for; C: a rerun an hour later,
    steps 15-16 at 4 s. Kept: A's 1-6 (12 s), B's 7-14 (16 s), C's 15-16 (8 s) = 36 s. Wall: 60 + 50 + 20 seconds
    of processes + B's 30 s downtime (C's hour is no fault of the run) = 160 s."""
    a = ProcessSpan(started_at=1000.0, ranks=2, seconds=60.0, first_step=1, last_step=10, steps=10, step_seconds=20.0)
    b = ProcessSpan(started_at=1090.0, ranks=2, seconds=50.0, first_step=7, last_step=14, steps=8, step_seconds=16.0,
                    restart=1, fault_at=1062.0)
    c = ProcessSpan(started_at=5000.0, ranks=2, seconds=20.0, first_step=15, last_step=16, steps=2, step_seconds=8.0)
    assert [redone_steps(a, [b, c]), redone_steps(b, [c]), redone_steps(c, [])] == [4, 0, 0]
    assert (downtime(a, b), downtime(b, c)) == (30.0, 0.0)
    assert run_goodput([a, b, c]) == pytest.approx(36.0 / 160.0)
    assert run_goodput([]) == 0.0
    unlogged = ProcessSpan(started_at=0.0, ranks=1, seconds=5.0)  # died during start-up: all of it is lost time
    assert run_goodput([unlogged, a]) == pytest.approx(20.0 / 65.0)


def test_a_restart_reads_the_time_of_the_last_fault_the_agents_recorded(tmp_path: Path) -> None:
    """The clock reads the agents' own fault records as plain JSON (the launcher sits above it): the latest time of
    any node's record, whatever order the files were written in, and None in a run with no fault yet."""
    assert last_fault_time(tmp_path) is None
    history = FaultHistory(faults_dir(tmp_path))
    for when, host in ((1062.0, "n2"), (1000.0, "n1")):
        history.add(FaultRecord(when, "job", host, 0, "signal", 1, "died of SIGKILL", "phase1 step 3", None, None,
                                True, 0, 2, "rank 1 died of SIGKILL"))
    (faults_dir(tmp_path) / "not-ours.json").write_text("{", encoding="utf-8")
    assert last_fault_time(tmp_path) == 1062.0
