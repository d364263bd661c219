"""Process helpers for the local cluster and its tests: free loopback ports, finding daemon programs,
waiting for a condition, and finding processes (and their environment) by a marker in /proc."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

SYSTEM_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
APT_PACKAGES = "slurm-wlm munge openssh-server pdsh"
INSTALL_HINT = f"apt-get install -y --no-install-recommends {APT_PACKAGES} (.ci/run does)"


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the daemons; the message says why (the tests skip with it)."""




def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_programs(names: Sequence[str]) -> dict[str, str]:
    """Absolute paths of `names` (sbin folders included: sshd, slurmd); ClusterUnavailable if one is missing."""
    found = {name: shutil.which(name, path=SYSTEM_PATH) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise ClusterUnavailable(f"{', '.join(missing)} not installed; {INSTALL_HINT}")
    return {name: str(path) for name, path in found.items()}


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


def processes_mentioning(marker: str) -> list[int]:
    """Pids whose command line contains `marker` (e.g. a test's unique run folder), this process excluded.

    Ranks started over ssh are children of sshd, not of the test: this is how a test finds them to
    read their CPU affinity, to kill one node's rank on purpose, or to stop leftovers by pid.
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def process_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode("utf-8", "replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)
    return dict(pairs)


def parent(pid: int) -> int:
    """The parent pid of `pid` (/proc/PID/stat), 0 when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0
