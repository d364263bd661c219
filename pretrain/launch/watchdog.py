"""launch.sh's watchdog: every process of a job ends when the job's `launch.sh` ends, however it ends.

launch.sh runs each command in a process group of its own (so that it can pass signals on itself); a
SIGKILL of launch.sh or of its group would leave that group running with no parent. The watchdog, in a
group of its own, waits for launch.sh's pid to vanish and then stops the job's group: SIGTERM (the ranks
checkpoint), SIGKILL after a grace period. Standard library only: launch.sh runs it with nothing else imported.

    python -m pretrain.launch.watchdog LAUNCH_SH_PID JOB_PGID [--grace SECONDS]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time

DEFAULT_GRACE_SECONDS = 30.0


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.watchdog",
                                     description="stop process group PGID once PID is gone")
    parser.add_argument("pid", type=int)
    parser.add_argument("pgid", type=int)
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS)
    args = parser.parse_args(argv)
    return watch(args.pid, args.pgid, args.grace)


if __name__ == "__main__":
    sys.exit(main())
