"""How an agent reads RUN/logs/faults/ (pretrain/launch/fault_history.py): its own launch's records only, each file
once, off its main thread under a time limit; the launch before read only when its own has none. Real files in a
real folder; a named pipe stands for a file that blocks whoever opens it (a hung shared file system)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pretrain.launch.fault_history import FaultHistory, launch_of
from pretrain.launch.faults import FaultRecord


def record(job: str, restart: int, when: float, host: str = "n1", cause: str = "died of SIGKILL") -> FaultRecord:
    return FaultRecord(when, job, host, restart, "signal", 1, cause, "phase1 step 5", None, "phase1-step0000004", True,
                       0, 3, f"rank 1 {cause}")


def blocking_file(path: Path) -> Path:
    os.mkfifo(path)  # open() for reading waits for a writer: for ever, unless the test lets it go
    return path


def release(path: Path) -> None:
    """The blocked reader, if any, gets its end of file (none waiting: ENXIO, nothing to release)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_only_the_launchs_own_records_are_read_each_once(tmp_path: Path) -> None:
    writer = FaultHistory(tmp_path)
    writer.add(record("launch-a", 0, 100.0))
    writer.add(record("launch-b", 0, 200.0))
    writer.add(record("launch-b", 1, 300.0, host="n2"))
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert [launch_of(name) for name in names] == ["launch-a", "launch-b", "launch-b"]
    other = blocking_file(tmp_path / f"{names[-1].split('~')[0]}9~launch-c~n3~1.json")  # another launch's, newest
    try:
        reader = FaultHistory(tmp_path, read_limit_s=20)
        assert [(r.job, r.restart) for r in reader.records("launch-b")] == [("launch-b", 0), ("launch-b", 1)]
        assert other.name not in reader.read  # never opened: it would have blocked the reader until the limit
        assert reader.spent_since("launch-b", "phase1-step0000004", 2) == 2
        # read once: a file rewritten since is not read again (its record was kept)
        (tmp_path / names[1]).write_text("{}")
        assert len(reader.records("launch-b")) == 2
    finally:
        release(other)


def test_a_folder_that_blocks_costs_the_limit_once_and_the_kept_records_are_used(tmp_path: Path) -> None:
    """A record of this launch that blocks whoever opens it: the judgement goes on after the limit, with what was
    read (before: the agent's main thread blocked in judge for as long as the file system)."""
    FaultHistory(tmp_path).add(record("launch-b", 0, 100.0))
    reader = FaultHistory(tmp_path, read_limit_s=0.5)
    assert len(reader.records("launch-b")) == 1
    stuck = blocking_file(tmp_path / "99999999999999999999~launch-b~n2~7.json")
    try:
        assert [r.restart for r in reader.records("launch-b")] == [0]  # after 0.5 s, from the kept record
        assert reader.spent_since("launch-b", "phase1-step0000004", 1) == 1
    finally:
        release(stuck)


def test_a_launchs_first_attempt_is_compared_with_the_last_attempt_of_the_launch_before(tmp_path: Path) -> None:
    """A requeue's first fault against the previous launch's last attempt (its records only, every node's); a record
    written before the launch was in the file name counts as an earlier launch's."""
    legacy = tmp_path / f"{time.time_ns() - 10**12}-n1-1.json"  # TIME-HOST-PID, written a while before
    legacy.write_text(record("launch-0", 0, 50.0).to_json())
    history = FaultHistory(tmp_path)
    assert [(r.job, r.restart) for r in history.previous_attempt("launch-a", 0)] == [("launch-0", 0)]
    history.add(record("launch-a", 0, 100.0))
    history.add(record("launch-a", 1, 200.0))
    history.add(record("launch-a", 1, 200.5, host="n2", cause="exited with status 1"))
    reader = FaultHistory(tmp_path)
    last = reader.previous_attempt("launch-b", 0)
    assert sorted((r.job, r.restart, r.host) for r in last) == [("launch-a", 1, "n1"), ("launch-a", 1, "n2")]
    assert legacy.name not in reader.read  # the launch before was enough
    reader.add(record("launch-b", 0, 300.0))
    assert [(r.job, r.restart) for r in reader.previous_attempt("launch-b", 1)] == [("launch-b", 0)]
