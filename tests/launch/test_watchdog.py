"""launch.sh's watchdog with real processes: once launch.sh is gone, its job's process group is stopped."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.distributed.test_lifetime import BOUND_S, wait_gone
from tests.support.paths import REPO_ROOT


def group_members(pgid: int, expected: int) -> list[int]:
    """The pids of process group `pgid`, waited for until `expected` are there (or BOUND_S passed)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        members = [int(p) for p in subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True,
                                                   text=True).stdout.split()]
        if len(members) >= expected or time.monotonic() > deadline:
            return members
        time.sleep(0.05)


def test_watchdog_stops_the_job_group_once_its_launch_sh_is_killed() -> None:
    stand_in = subprocess.Popen(["sleep", "300"])  # launch.sh
    job = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    watchdog = subprocess.Popen([sys.executable, "-m", "pretrain.launch.watchdog", str(stand_in.pid), str(job.pid),
                                 "--grace", "5"], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    members = group_members(job.pid, 3)  # bash and its two sleeps, however long the machine takes to start them
    assert len(members) == 3 and watchdog.poll() is None  # still waiting: launch.sh lives
    stand_in.kill()
    stand_in.wait()
    assert watchdog.wait(timeout=BOUND_S) == 0
    job.wait(timeout=BOUND_S)
    assert wait_gone(members) == []
    assert f"launch.sh (pid {stand_in.pid}) is gone: stopping its job (process group {job.pid})" in watchdog.stderr.read()
