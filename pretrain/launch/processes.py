"""The processes the agent watches, read from /proc and signalled: Linux only, standard library only.

Whether a rank is still there (a zombie is not: it only waits to be reaped), whether it has a handler for a signal
yet (a rank still starting has none, and the signal's default action would kill it), when it started (pids are
reused), whether a signal sent to it was taken yet, and waiting until killed ones are gone.
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path


def _stat_fields(pid: int, proc: Path) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first); None when unreadable."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split() if ")" in stat else None


def process_state(pid: int, proc: Path = Path("/proc")) -> str:
    """The state letter of /proc/PID/stat ("" when unreadable)."""
    fields = _stat_fields(pid, proc)
    return fields[0] if fields else ""


def running(pid: int) -> bool:
    """Whether `pid` still runs: not gone, and not a zombie (dead, waiting to be reaped: it holds nothing)."""
    return process_state(pid) not in ("", "Z")


def process_start(pid: int, proc: Path = Path("/proc")) -> int | None:
    """When process `pid` started (clock ticks since boot, field 22 of /proc/PID/stat); None when it is gone or a
    zombie. A pid with another start time is another process: pids are reused."""
    fields = _stat_fields(pid, proc)
    return int(fields[19]) if fields and len(fields) > 19 and fields[0] != "Z" else None


def wait_until_gone(pids: list[int], limit_s: float) -> list[int]:
    """Wait (up to `limit_s`) until each of `pids` has exited: a rank killed on a GPU holds its memory until the
    driver has torn its context down, and a restart that starts sooner lands on a GPU still held. Returns the pids
    still there (in D state: torch's uninterruptible-state check names them)."""
    deadline = time.monotonic() + limit_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if running(pid)]
        if left:
            time.sleep(0.05)
    return left


def wait_bounded(proc: subprocess.Popen[str], done: Callable[[], bool], grace_s: float) -> int | None:
    """`proc`'s status once it ends; but once `done()` holds it gets `grace_s` more, then is killed (SIGKILL) and
    None returned: a process that only waits on others' channels (pdsh on its ssh sessions) ends with them."""
    deadline = None
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if deadline is None and done():
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return None


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (SigCgt of /proc/PID/status)."""
    return _status_bit(pid, "SigCgt:", signum)


def pending(pid: int, signum: int) -> bool:
    """Whether `signum`, sent to process `pid`, still waits to be taken (ShdPnd of /proc/PID/status: a signal sent to
    a process waits there until one of its threads takes it, which runs the handler at once)."""
    return _status_bit(pid, "ShdPnd:", signum)


def _status_bit(pid: int, field: str, signum: int) -> bool:
    """`signum`'s bit of a signal mask line of /proc/PID/status (`field`: "SigCgt:", "ShdPnd:"); False when the
    process is gone or the line is missing."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return bool((int(line.split()[1], 16) >> (signum - 1)) & 1)
    except (OSError, ValueError):
        pass
    return False


def stderr_size(pid: int) -> int | None:
    """The size of the file process `pid` writes its stderr to (a rank's log under the agent); None when its stderr is
    no regular file (a terminal, a pipe) or it is gone."""
    try:
        info = os.stat(f"/proc/{pid}/fd/2")
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def ended_badly(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether `pid` has ended with a non-zero status or by a signal and waits to be reaped (a zombie: /proc/PID/stat's
    last field holds its waitpid status until then). Read without reaping it, so torch still collects it as usual."""
    fields = _stat_fields(pid, proc)
    return fields is not None and len(fields) > 49 and fields[0] == "Z" and int(fields[49]) != 0


def send_when_caught(pid: int, signum: int) -> None:
    """`signum` to rank `pid` once it has its handler (installed first thing by the driver, before its imports), so
    that a stop that comes while a rank starts is a stop too: that rank checkpoints at its first step, as a rank
    signalled during start-up does. Nothing when it ends first."""
    while running(pid):
        if catches(pid, signum):
            kill(pid, signum)
            return
        time.sleep(0.02)


def pass_on(pids: list[int], signum: int) -> None:
    """A stop to each of `pids`: at once to those with a handler for it; a rank still starting would die of the
    signal's default action (a fault, status 143), so a thread passes it on once the rank has one."""
    for pid in pids:
        if catches(pid, signum):
            kill(pid, signum)
        else:
            threading.Thread(target=send_when_caught, args=(pid, signum), daemon=True).start()


def kill(pid: int, signum: int) -> None:
    """`signum` to `pid`; nothing when it is gone, or is no longer ours (its pid reused by another user's)."""
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
