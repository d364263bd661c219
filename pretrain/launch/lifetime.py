"""Process lifetime: every process of a job ends when the job's `launch.sh` ends, however it ends.

Standard library only (launch.sh runs the watchdog below with nothing else imported). Three pieces:

- `die_with_parent`: PR_SET_PDEATHSIG (Linux prctl), so a rank or a demo child gets SIGTERM when the
  process that started it dies, even of SIGKILL. The kernel sends it when the parent *thread* exits,
  so children are started from a thread that lives as long as they do (the main thread here).
- `watch`: launch.sh's watchdog. launch.sh runs each command in a process group of its own (so that
  it can pass signals on itself); a SIGKILL of launch.sh or of its group would leave that group
  running with no parent. The watchdog, in a group of its own, waits for launch.sh's pid to vanish
  and then stops the job's group: SIGTERM (the ranks checkpoint), SIGKILL after a grace period.
- `hold_run_folder`: an exclusive flock on RUN_DIR/.job.lock held by the job's rank 0 for the
  process's life, so a second job refuses a run folder a live job still writes into. The kernel
  drops a flock when its holder dies, so the lock is never stale.

    python -m pretrain.launch.lifetime watch LAUNCH_SH_PID JOB_PGID [--grace SECONDS]
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

from pretrain.run_folder import JOB_LOCK

PR_SET_PDEATHSIG = 1
DEFAULT_GRACE_SECONDS = 30.0


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies. False where unsupported.

    Also survives exec, so `preexec_fn=die_with_parent` gives a child (a shell script included) the same.
    If the parent is already gone when this runs (we were reparented), the signal is sent at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # it died between the two reads
        os.kill(os.getpid(), signum)
    return True


# ---------------------------------------------------------------------- watchdog
def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for_exit(pid: int, pgid: int) -> bool:
    """Block until `pid` is gone (True) or the job's group `pgid` is (False: nothing left to stop)."""
    try:
        handle = os.pidfd_open(pid)  # wakes the moment the process exits, whoever its parent is
    except (OSError, AttributeError):
        handle = None
    try:
        while True:
            if handle is not None:
                ready, _, _ = select.select([handle], [], [], 1.0)
                if ready:
                    return True
            else:
                time.sleep(0.5)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return True
                except PermissionError:
                    pass
            if not _group_alive(pgid):
                return False
    finally:
        if handle is not None:
            os.close(handle)


def stop_group(pgid: int, grace: float) -> None:
    """SIGTERM to the group, then SIGKILL to whatever is left after `grace` seconds."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def watch(pid: int, pgid: int, grace: float = DEFAULT_GRACE_SECONDS) -> int:
    """The watchdog's whole life: wait for launch.sh (`pid`), then stop its job's group `pgid`."""
    for ignored in (signal.SIGINT, signal.SIGHUP):  # only launch.sh's end stops it
        signal.signal(ignored, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # launch.sh's way of saying the job ended by itself
    if _wait_for_exit(pid, pgid) and _group_alive(pgid):
        print(f"launch.sh (pid {pid}) is gone: stopping its job (process group {pgid}): SIGTERM, "
              f"SIGKILL after {grace:.0f} s", file=sys.stderr, flush=True)
        stop_group(pgid, grace)
    return 0


# ---------------------------------------------------------------------- run folder lock
class RunFolderBusyError(RuntimeError):
    """Another live process holds the run folder's lock."""


_held: dict[Path, int] = {}  # run folder -> the descriptor holding its flock in this process


def hold_run_folder(run_dir: Path) -> None:
    """Take RUN_DIR/.job.lock for this process's life (again in the same process: a no-op).

    Raises RunFolderBusyError naming the holder. On a file system without flock (some Lustre
    mounts) it returns without a lock: the lock is a second protection, the watchdog the first.
    """
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / JOB_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunFolderBusyError(
            f"run.dir {run_dir} is in use by a live job ({holder}; lock {path}): stop that job, or use another "
            "run.dir") from None
    except OSError:  # no flock on this file system
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held[run_dir] = fd


def release_run_folder(run_dir: Path) -> None:
    """Drop this process's lock on `run_dir` (in-process callers that train the same folder again)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.lifetime", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    watcher = sub.add_parser("watch", help="stop process group PGID once PID is gone")
    watcher.add_argument("pid", type=int)
    watcher.add_argument("pgid", type=int)
    watcher.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS)
    args = parser.parse_args(argv)
    return watch(args.pid, args.pgid, args.grace)


if __name__ == "__main__":
    sys.exit(main())
