"""pretrain/launch/hang_watch.py ask_for_stacks on real processes: a rank asked for its stacks has written all of them
(every thread, down to its outermost frame) by the time the asking returns, whether it sleeps, computes or keeps
writing to its log; and the wait ends once they are written (wait_for_stacks names no rank still writing), not at
its limit. The agent kills the rank right after (pretrain/launch/survivors.py), as the test does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pretrain.distributed.step_watch import STACKS_SIGNAL
from pretrain.launch.hang_watch import ask_for_stacks, wait_for_stacks
from pretrain.launch.processes import catches, process_start, process_state, stderr_size

# A "rank": the driver's stacks handler (step_watch.dump_stacks_on_signal), a helper thread, and a main thread that
# waits in a nested call, sleeping, computing, writing a line to its log every millisecond, or holding 400 MB.
RANK = textwrap.dedent("""
    import faulthandler, signal, sys, threading, time
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True, chain=False)

    def helper_thread_loop():
        while True:
            time.sleep(0.01)

    def innermost_wait(mode):
        held = bytearray(400_000_000) if mode == "holds memory" else b""  # a rank's size: its exit takes a moment
        print("ready", flush=True)
        while held is not None:
            if mode in ("sleeps", "holds memory"):
                time.sleep(0.01)
            elif mode == "computes":
                sum(range(1000))
            else:
                print("a line of progress", file=sys.stderr, flush=True)
                time.sleep(0.001)

    def outer_call(mode):
        innermost_wait(mode)

    threading.Thread(target=helper_thread_loop, daemon=True).start()
    outer_call(sys.argv[1])
""")


def start_rank(mode: str, log: Path) -> subprocess.Popen[str]:
    with log.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", RANK, mode], stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    assert catches(proc.pid, STACKS_SIGNAL)
    return proc


def whole_stacks(text: str) -> bool:
    """Both threads' stacks, the main thread's down to its outermost frame (faulthandler writes it last)."""
    return all(f"in {name}" in text for name in ("helper_thread_loop", "innermost_wait", "outer_call", "<module>"))


@pytest.mark.parametrize("mode", ["sleeps", "computes", "writes"])
def test_a_rank_asked_for_its_stacks_has_written_them_all_when_the_asking_returns(mode: str, tmp_path: Path) -> None:
    log = tmp_path / "rank.log"
    proc = start_rank(mode, log)
    try:
        assert ask_for_stacks([proc.pid], {}) == {proc.pid}
    finally:
        proc.kill()  # at once, as the agent does after asking
        proc.wait()
    assert "most recent call first" in log.read_text() and whole_stacks(log.read_text()), log.read_text()[-3000:]


def test_the_wait_ends_once_the_stacks_are_written_not_at_its_limit(tmp_path: Path) -> None:
    log = tmp_path / "rank.log"
    proc = start_rank("sleeps", log)
    try:
        before = stderr_size(proc.pid)
        assert before == 0  # its stderr is the log file
        os.kill(proc.pid, STACKS_SIGNAL)
        assert wait_for_stacks({proc.pid: before}, limit_s=120) == set()  # seen written: it stopped waiting for them
        assert whole_stacks(log.read_text()) and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_with_no_handler_or_a_stopped_one_is_not_asked(tmp_path: Path) -> None:
    plain = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    stopped = start_rank("sleeps", tmp_path / "stopped.log")
    try:
        assert plain.stdout is not None and plain.stdout.readline() == "ready\n"
        os.kill(stopped.pid, signal.SIGSTOP)
        while process_state(stopped.pid) != "T":  # the stop is delivered asynchronously
            time.sleep(0.01)
        assert ask_for_stacks([plain.pid, stopped.pid], {}) == set()
        assert plain.poll() is None  # SIGUSR2's default action would have ended it
    finally:
        for proc in (plain, stopped):
            proc.kill()
            proc.wait()


def test_a_frozen_rank_killed_with_its_timed_out_peer_is_not_asked_again_when_its_own_timer_runs_out(
        tmp_path: Path) -> None:
    """Both ranks' timers run out together (a rank frozen at start-up, its peer waiting for it): the peer is reaped
    first, the frozen one named and killed with it, unasked. Its own timer comes next in the same round of the timer
    server; the process may still be dying (its memory being freed): it is not asked for stacks then either, so the
    fault line does not promise stacks its log lacks."""
    from pretrain.launch.hang_watch import HangWatch, Limits  # torch's timer server: only these tests need it

    waiting = start_rank("sleeps", tmp_path / "waiting.log")
    frozen = start_rank("holds memory", tmp_path / "frozen.log")
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        while process_state(frozen.pid) != "T":
            time.sleep(0.01)
        watch = HangWatch(str(tmp_path / "timers"), Limits(hang_s=6.0, startup_s=15.0))
        for pid in (waiting.pid, frozen.pid):  # as arm() and the ranks' start-up timers leave them
            watch.started[pid] = process_start(pid)
            watch.last_step[pid] = "start-up"
        assert watch._reap_worker(waiting.pid, signal.SIGKILL) and watch._reap_worker(frozen.pid, signal.SIGKILL)
        assert waiting.wait(timeout=30) == -signal.SIGKILL and frozen.wait(timeout=30) == -signal.SIGKILL
        assert watch.stacks == {waiting.pid} and set(watch.hung) == {waiting.pid, frozen.pid}
        assert "most recent call first" not in (tmp_path / "frozen.log").read_text()
    finally:
        for proc in (waiting, frozen):
            proc.kill()
            proc.wait()
