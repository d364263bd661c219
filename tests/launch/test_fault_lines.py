"""pretrain/launch/faults.py: which failure is named, what the line says, and when restarts stop, on real
files (a run folder's `latest`, a rank's log, the failure record) and real processes (/proc states).
The end-to-end runs are tests/launch/test_faults.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from pretrain.launch.faults import (
    FailureRecord,
    FaultContext,
    RankFailure,
    judge,
    primary_failure,
    process_state,
)


def failure(tmp_path: Path, rank: int = 1, exitcode: int = -9, step: str | None = "phase1 step 12",
            hang: str | None = None) -> RankFailure:
    return RankFailure(rank, "node7", exitcode, step, tmp_path / f"rank-{rank}.log", hang)


def context(tmp_path: Path, max_restarts: int = 3, latest: str | None = "phase1-step0000010") -> FaultContext:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    if latest:
        (checkpoints / "latest").write_text(latest + "\n")
    return FaultContext(max_restarts, checkpoints, "./launch.sh pretrain --config run.json")


def test_the_rank_that_failed_first_is_named_not_the_ones_that_followed(tmp_path: Path) -> None:
    peer = failure(tmp_path, rank=0, exitcode=1)  # its collective lost the peer
    stopped_by_agent = failure(tmp_path, rank=2, exitcode=-signal.SIGTERM)
    killed = failure(tmp_path, rank=3, exitcode=-signal.SIGKILL)
    assert primary_failure([peer, stopped_by_agent, killed]) is killed
    assert primary_failure([stopped_by_agent, peer]) is peer
    waiting = failure(tmp_path, rank=0, hang="made no progress in 10 min (running but not progressing)")
    frozen = failure(tmp_path, rank=1, hang="made no progress in 10 min (stopped by SIGSTOP)")
    assert primary_failure([waiting, killed, frozen]) is frozen
    assert primary_failure([waiting, killed]) is waiting


def test_a_fault_restarts_with_one_line_until_the_budget_is_spent(tmp_path: Path) -> None:
    record = FailureRecord(tmp_path / "logs" / "last_failure.json")
    verdict = judge(failure(tmp_path), 0, context(tmp_path), record)
    assert verdict.restart and verdict.line == (
        f"fault: rank 1 (host node7) died of SIGKILL at phase1 step 12; restarting from checkpoint "
        f"phase1-step0000010 (restart 1 of 3); log: {tmp_path / 'rank-1.log'}")
    later = failure(tmp_path, exitcode=1, step="phase1 step 15")
    verdict = judge(later, 3, context(tmp_path), record)
    assert not verdict.restart and verdict.exit_status == 1
    assert verdict.line.startswith("error: rank 1 (host node7) exited with status 1 at phase1 step 15; no restart "
                                   "left (run.max_restarts=3); last checkpoint phase1-step0000010; log: ")
    assert verdict.line.endswith("; resume with: ./launch.sh pretrain --config run.json")
    (tmp_path / "new").mkdir()
    fresh = judge(failure(tmp_path, step=None), 0, context(tmp_path / "new", latest=None),
                  FailureRecord(tmp_path / "new" / "last_failure.json"))
    assert "during start-up; restarting from the start (no checkpoint yet) (restart 1 of 3)" in fresh.line


def test_the_same_step_again_with_no_newer_checkpoint_stops_the_restarts(tmp_path: Path) -> None:
    record = FailureRecord(tmp_path / "last_failure.json")
    assert judge(failure(tmp_path), 0, context(tmp_path), record).restart
    again = judge(failure(tmp_path, rank=0, exitcode=1), 1, context(tmp_path), record)
    assert not again.restart and "a bug, not a fault" in again.line and "resume with:" in again.line
    # a newer checkpoint in between is progress: the same step number is a new fault
    record.clear()
    assert judge(failure(tmp_path), 0, context(tmp_path), record).restart
    assert judge(failure(tmp_path), 1, context(tmp_path, latest="phase1-step0000012"), record).restart


def test_a_config_error_is_its_own_line_once_and_nan_losses_are_not_restarted(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text("Traceback (most recent call last):\n  ...\nconfig error: data.shards: x: sha256 differs\n"
                   "terminate called without an active exception\n")
    record = FailureRecord(tmp_path / "last_failure.json")
    verdict = judge(failure(tmp_path, rank=0, exitcode=2), 0, context(tmp_path), record)
    assert (verdict.restart, verdict.line, verdict.exit_status) == (
        False, "config error: data.shards: x: sha256 differs", 2)
    nan = judge(failure(tmp_path, rank=0, exitcode=3), 0, context(tmp_path), record)
    assert not nan.restart and nan.exit_status == 3 and "NaN/inf losses, not restarted" in nan.line


def test_process_state_tells_a_stopped_process(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == ""  # gone


def test_the_hang_watch_names_a_frozen_peer_whose_timer_did_not_run_out(tmp_path: Path) -> None:
    """A rank frozen between two steps holds no timer: its peer, waiting in a collective, times out first.
    The agent's timer server kills the waiting peer and names the frozen one too."""
    from pretrain.launch.agent import HangWatch  # imports torch's elastic agent: only this test needs it

    frozen, waiting = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
    try:
        frozen.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(frozen.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        watch = HangWatch(str(tmp_path / "timers"), "run", timeout_s=6.0)
        watch.last_step.update({frozen.pid: "phase1 step 7", waiting.pid: "phase1 step 8"})
        assert watch._reap_worker(waiting.pid, signal.SIGKILL)
        assert waiting.wait(timeout=10) == -signal.SIGKILL
        assert watch.hung == {waiting.pid: "made no progress in 0.1 min (running but not progressing)",
                              frozen.pid: "made no progress in 0.1 min (stopped by SIGSTOP)"}
    finally:
        for child in (frozen, waiting):
            child.kill()
            child.wait()
