"""pretrain/launch/processes.py on real processes: a stop that comes before a rank has its handler is held until it
has one (the signal's default action would kill it: a fault, status 143, instead of a stop), and killed ranks are
waited for until they are gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from pretrain.launch.processes import (
    catches,
    ended_badly,
    process_start,
    process_state,
    send_when_caught,
    wait_until_gone,
)

# A "rank" that takes a moment before it installs its SIGTERM handler (as an interpreter importing torch does), then
# waits for the signal and exits 0 once it has handled it.
LATE_HANDLER = textwrap.dedent("""
    import signal, sys, time
    time.sleep(0.5)
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))
    print("ready", flush=True)
    while not got:
        time.sleep(0.01)
    sys.exit(0)
""")


def test_a_stop_sent_before_the_handler_waits_for_it_and_is_handled() -> None:
    child = subprocess.Popen([sys.executable, "-c", LATE_HANDLER], stdout=subprocess.PIPE, text=True)
    try:
        assert not catches(child.pid, signal.SIGTERM)  # still starting: SIGTERM now would kill it
        started = time.monotonic()
        send_when_caught(child.pid, signal.SIGTERM)  # returns once it was sent
        assert catches(child.pid, signal.SIGTERM) and time.monotonic() - started >= 0.3
        assert child.wait(timeout=30) == 0  # handled: a stop, not a death by SIGTERM (-15)
    finally:
        child.kill()


def test_nothing_is_sent_to_a_process_that_ends_before_it_has_a_handler() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    send_when_caught(child.pid, signal.SIGTERM)  # returns when it is gone (a zombie until reaped)
    assert child.wait(timeout=30) == 0


def test_killed_processes_are_waited_for_and_a_reused_pid_is_told_apart() -> None:
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        started = {child.pid: process_start(child.pid) for child in children}
        assert all(started.values()) and all(process_state(pid) in ("S", "R") for pid in started)
        for child in children:
            child.kill()
        assert wait_until_gone(list(started), limit_s=30) == []  # zombies count as gone: they hold nothing
        assert all(process_start(pid) is None for pid in started)
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert wait_until_gone([alive.pid], limit_s=0.2) == [alive.pid]  # still there after the limit
        finally:
            alive.kill()
            alive.wait()
    finally:
        for child in children:
            child.wait()


def test_a_rank_that_ended_badly_is_told_before_it_is_reaped_and_one_that_ended_well_is_not() -> None:
    """The agent reads it before torch's poll reaps the rank (and stops the others with SIGTERM and a grace)."""
    failed = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        killed.kill()
        assert wait_until_gone([failed.pid, killed.pid, done.pid], limit_s=30) == []  # zombies, not reaped yet
        assert ended_badly(failed.pid) and ended_badly(killed.pid)
        assert not ended_badly(done.pid) and not ended_badly(running.pid)
        assert failed.wait() == 3 and killed.wait() == -signal.SIGKILL  # torch still reaps them as usual
        assert not ended_badly(failed.pid)  # reaped: gone
    finally:
        running.kill()
        for child in (failed, killed, done, running):
            child.wait()
