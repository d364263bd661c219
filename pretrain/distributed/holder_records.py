"""Is the holder of a file provably dead? What a process can and cannot know about the others on its machine.

Cleanup of leftover files (a JIT build's lock, a timer pipe) must never remove one a live process still uses. The
natural test, "no process I can see holds it", is only as good as what this process sees:

- Another pid namespace (a container, an enroot/Apptainer/podman job sharing the home folder) is invisible from a
  sibling namespace: its processes are simply not in /proc. Only the initial pid namespace sees every process of
  the machine; its /proc/self/ns/pid link names the inode the kernel fixes for it (PROC_PID_INIT_INO).
- A process whose descriptors cannot be read (/proc/PID/fd refused) may hold anything. Other users' processes
  usually cannot hold our files; but one of our own uid, or one whose uid is not mapped into our user namespace
  (shown as the overflow uid), may be us in another user namespace.

So a file's holder can be recorded beside it (`HolderRecord`: host, boot, pid namespace, pid and the pid's start
time), and a cleanup removes the file only when `provably_dead` says so from that record, or when it sees every
process that could hold it (`sees_every_possible_holder`). Otherwise the file may be held: only an age limit may
remove it. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")
INITIAL_PID_NAMESPACE = "pid:[4026531836]"  # the kernel's fixed inode of the initial pid namespace (0xEFFFFFFC)
BOOT_ID = PROC / "sys" / "kernel" / "random" / "boot_id"  # new at every boot: a pid of an earlier boot is gone
OVERFLOW_UID = PROC / "sys" / "kernel" / "overflowuid"  # how an uid not mapped into our user namespace shows


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def pid_namespace(pid: int | str = "self") -> str:
    """The pid namespace of a process ("pid:[inode]"), "" when it cannot be read."""
    try:
        return os.readlink(PROC / str(pid) / "ns" / "pid")
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot, /proc/PID/stat field 22): another process given the same pid
    later has another start. None when no such process is visible."""
    stat = _read(PROC / str(pid) / "stat")
    fields = stat.rpartition(")")[2].split()
    return int(fields[19]) if len(fields) > 19 else None


@dataclass(frozen=True)
class HolderRecord:
    """Who holds a file, in terms another process can check: which machine and boot, which pid namespace, which
    process (pid and start time, so a reused pid is not taken for the holder)."""

    host: str
    boot_id: str
    pid_namespace: str
    pid: int
    started: int | None

    @classmethod
    def of(cls, pid: int) -> HolderRecord:
        """The record of `pid`, a process of this machine visible here (this process's own namespace)."""
        return cls(socket.gethostname(), _read(BOOT_ID), pid_namespace(), pid, process_start(pid))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HolderRecord | None:
        """The record a file holds, None when it is not one (then it proves nothing)."""
        try:
            return cls(str(data["host"]), str(data["boot_id"]), str(data["pid_namespace"]), int(data["pid"]),
                       None if data["started"] is None else int(data["started"]))
        except (KeyError, TypeError, ValueError):
            return None

    def same_namespace(self) -> bool:
        """Whether the recorded pid means the same process here: this machine, this boot, this pid namespace."""
        return (self.host == socket.gethostname() and self.boot_id == _read(BOOT_ID) != ""
                and self.pid_namespace == pid_namespace() != "")


def provably_dead(record: HolderRecord) -> bool:
    """True only when the recorded holder is certainly gone: recorded in this very pid namespace of this machine
    and boot, and its pid is gone or now another process (another start time). A holder in another container,
    on another machine or of an earlier record format is never proven dead."""
    if not record.same_namespace():
        return False
    started = process_start(record.pid)
    return started is None or (record.started is not None and started != record.started)


def sees_every_process() -> bool:
    """Whether /proc here lists every process of the machine (this is the initial pid namespace)."""
    return pid_namespace() == INITIAL_PID_NAMESPACE


def could_be_ours(pid: int) -> bool:
    """Whether a process whose descriptors could not be read may still be one of ours: it runs as our uid (seen
    from here: another user namespace of ours) or as an uid not mapped into our user namespace."""
    try:
        owner = (PROC / str(pid)).stat().st_uid
    except OSError:
        return False  # gone meanwhile
    overflow = _read(OVERFLOW_UID)
    return owner == os.geteuid() or (overflow.isdigit() and owner == int(overflow))


def sees_every_possible_holder(unreadable: list[int]) -> bool:
    """Whether a file that no visible process holds is certainly unheld on this machine: every process is visible
    here and none of those whose descriptors could not be read (`unreadable`) may be ours."""
    return sees_every_process() and not any(could_be_ours(pid) for pid in unreadable)


def write_record(path: Path, data: dict[str, Any]) -> None:
    """`data` as JSON at `path`, atomically (a reader sees the old record or the new one), readable by all."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path`; None when absent or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
