"""DeepSpeed's just-in-time ops (the CPU communication op first): no silent compile, no stale lock.

torch.utils.cpp_extension serializes a build with a FileBaton: `BUILD_DIR/lock` created with
O_CREAT|O_EXCL, its descriptor kept open by the building process until the build ends, then the file
removed. Every other process waits for the file to go, printing nothing and with no time limit. A
build killed midway (Ctrl-C, SIGKILL during a first launch) leaves the file, and every later launch
waits on it forever.

Because the holder keeps the descriptor open, "stale" is exact where every possible holder is visible: a
lock that no process has open (seen twice, same inode) is left over. Only a process of the initial pid namespace
sees every process of the machine, and only if none of ours hides its descriptors (pretrain/distributed/
holder_records.py): from a container, a build in a sibling container sharing the home folder is invisible, and
removing its lock let two ninja builds share one folder (seen by a review: the first to finish removed the lock,
the other's release failed). So each lock a watcher sees held gets a record beside it, `lock.holder` (host, boot,
pid namespace, pid and its start time), and an unheld-looking lock is removed at once only when that record
proves its holder dead, or when every possible holder is visible. Otherwise it may be held: it is removed only
once older than BERT_DS_STALE_LOCK_MINUTES (30), and waiting on it is said; the same for a network file system,
where another machine may hold it. Processes of other users cannot be inspected; a lock one of them might hold
(the build folder is not ours) is never removed. Our own checks serialize on one flock, so two ranks never both
remove, and a lock is removed by renaming it aside and checking it is the one looked at.

The build tool: torch runs whichever `ninja` comes first on PATH, and ninja rebuilds a target whose
command hash in `.ninja_log` is not its own. Two ninjas hash differently (pip's ninja 1.13 in the
environment against a system ninja-build 1.11, both "log v7"), so on a machine with both, a launch
whose PATH lacks the environment's bin folder (ranks started over ssh/pdsh, a batch script with a
login PATH) recompiles the op, and the next ordinary launch recompiles it back: tens of seconds to
minutes each, every time the two alternate. Before a build may run, the ninja beside this
interpreter (the one the environment installed with DeepSpeed) is put first on PATH.

A build running in this process for more than a few seconds (a first use on this machine) prints one
line saying what it is and that it happens once per machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pretrain.distributed.holder_records import (
    HolderRecord,
    provably_dead,
    read_record,
    sees_every_possible_holder,
    write_record,
)

NETWORK_FILE_SYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs",
                        "fuse.sshfs", "fuse.glusterfs", "afs", "9p", "panfs", "wekafs"}
POLL_SECONDS = 2.0
HOLDER_RECORD = "lock.holder"  # beside torch's `lock`: who held it when a watcher saw it held (module docstring)
SAY_BUILDING_AFTER_SECONDS = 8.0


def say(message: str) -> None:
    # stdout: a rank's stderr goes to its log file under the elastic agent (pretrain/launch/agent.py)
    print(f"extensions: {message}", flush=True)


def extension_roots() -> list[Path]:
    """Where torch builds JIT extensions: $TORCH_EXTENSIONS_DIR/NAME, else ~/.cache/torch_extensions/pyXY_*/NAME."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return [Path(explicit)]
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(get_default_build_root())
    return sorted(p for p in root.glob("py*") if p.is_dir()) if root.is_dir() else []


def build_locks() -> list[Path]:
    return [lock for root in extension_roots() for lock in root.glob("*/lock")]


def holders(lock: Path) -> tuple[list[int], list[int]]:
    """The pids with `lock` open, and the pids whose descriptors could not be inspected (another user's, or ours
    in another user namespace)."""
    target = str(lock.resolve())
    found: list[int] = []
    hidden: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except PermissionError:
            hidden.append(int(proc.name))
            continue
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd) == target:
                    found.append(int(proc.name))
                    break
    return found, hidden


def file_system_type(path: Path) -> str:
    best, kind = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) >= 3 and str(path).startswith(fields[1].rstrip("/") + "/") and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


def stale_age_limit() -> float:
    return float(os.environ.get("BERT_DS_STALE_LOCK_MINUTES", "30")) * 60


def _remove_if_same(lock: Path, inode: int) -> bool:
    aside = lock.with_name(f"lock.stale.{os.getpid()}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    if aside.stat().st_ino != inode:  # a new build took the name in between: give it back
        os.rename(aside, lock)
        return False
    aside.unlink()
    return True


class BuildWatcher:
    """Looks at every build lock now and then; `check` is one look (the thread runs it in a loop)."""

    def __init__(self) -> None:
        self.said: set[tuple[str, Path]] = set()
        self.suspect: dict[Path, int] = {}  # lock -> inode seen unheld once
        self.started = time.monotonic()

    def check(self) -> None:
        for lock in build_locks():
            with contextlib.suppress(FileNotFoundError):
                self._check_one(lock)
        for record in (record for root in extension_roots() for record in root.glob(f"*/{HOLDER_RECORD}")):
            if not record.with_name("lock").exists():  # its build ended: the record proves nothing any more
                _forget_holder(record.with_name("lock"))

    def _say_once(self, kind: str, lock: Path, message: str) -> None:
        if (kind, lock) not in self.said:
            self.said.add((kind, lock))
            say(message)

    def _check_one(self, lock: Path) -> None:
        info = lock.stat()
        pids, hidden = holders(lock)
        name = lock.parent.name
        if pids:
            self.suspect.pop(lock, None)
            record_holder(lock, pids[0], info.st_ino)
            if time.monotonic() - self.started < SAY_BUILDING_AFTER_SECONDS:
                return
            if os.getpid() in pids:
                self._say_once("build", lock, f"compiling DeepSpeed's {name} op in {lock.parent} (once per machine, "
                               "a few minutes on few cores; later launches load it in seconds)")
            elif not any(_sibling(pid) for pid in pids):
                self._say_once("wait", lock, f"waiting for pid {pids[0]} to finish compiling {name} in "
                               f"{lock.parent} (once per machine)")
            return
        if hidden and lock.parent.stat().st_uid != os.getuid():
            self._say_once("foreign", lock, f"waiting on {lock}: the build folder is another user's, whose "
                           "processes cannot be inspected; remove the file if nobody is compiling")
            return
        age = time.time() - info.st_mtime
        holder = recorded_holder(lock, info.st_ino)
        proven = holder is not None and provably_dead(holder)
        if not proven and file_system_type(lock.resolve()) in NETWORK_FILE_SYSTEMS and age < stale_age_limit():
            self._say_once("remote", lock, f"waiting on {lock}: no process on this machine holds it (another "
                           f"machine may be compiling); removed as stale at {stale_age_limit() / 60:.0f} min "
                           "of age, or remove it yourself if no machine is compiling")
            return
        if not proven and (holder is not None or not sees_every_possible_holder(hidden)) \
                and age < stale_age_limit():
            where = (f"pid {holder.pid} on {holder.host} (pid namespace {holder.pid_namespace})" if holder
                     else "a process this one cannot inspect (another container or namespace on this machine)")
            self._say_once("hidden", lock, f"waiting on {lock}: its holder may be {where}; removed as stale at "
                           f"{stale_age_limit() / 60:.0f} min of age, or remove it yourself if nothing is compiling")
            return
        if self.suspect.get(lock) != info.st_ino:  # unheld once: look again before removing
            self.suspect[lock] = info.st_ino
            return
        with _checks_serialized(lock.parent.parent):
            if lock.exists() and lock.stat().st_ino == info.st_ino and not holders(lock)[0] \
                    and _remove_if_same(lock, info.st_ino):
                _forget_holder(lock)
                say(f"removed stale lock {lock} ({age:.0f} s old, no process holds it: left by an interrupted "
                    "compile)")
        self.suspect.pop(lock, None)


def record_holder(lock: Path, pid: int, inode: int) -> None:
    """Write who holds `lock` (this inode) beside it, once: from another pid namespace the holder is invisible,
    and the record is then what proves it alive or dead (module docstring)."""
    path = lock.with_name(HOLDER_RECORD)
    if (read_record(path) or {}).get("inode") == inode:
        return
    with contextlib.suppress(OSError):  # a folder we may not write: no record, the age limit then applies
        write_record(path, {"inode": inode, "holder": HolderRecord.of(pid).to_dict()})


def recorded_holder(lock: Path, inode: int) -> HolderRecord | None:
    """The recorded holder of this very lock (same inode); None when there is no such record."""
    data = read_record(lock.with_name(HOLDER_RECORD)) or {}
    holder = data.get("holder")
    return HolderRecord.from_dict(holder) if data.get("inode") == inode and isinstance(holder, dict) else None


def _forget_holder(lock: Path) -> None:
    with contextlib.suppress(OSError):
        lock.with_name(HOLDER_RECORD).unlink()


def _sibling(pid: int) -> bool:
    """True for another rank of this job (same parent): it speaks for the build itself."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == os.getppid()


@contextlib.contextmanager
def _checks_serialized(root: Path) -> Iterator[None]:
    fd = os.open(root / ".bert_ds_lock_check", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def use_environment_ninja() -> Path | None:
    """Put the folder of this interpreter's `ninja` (a virtual environment's bin) first on PATH, so every
    process of a job builds with the same ninja whatever PATH it was started with (module docstring).
    Returns that ninja, or None when the interpreter's folder has none (PATH is then left as it is)."""
    bin_dir = Path(sys.executable).parent  # not resolved: a venv's python is a symlink out of its bin
    ninja = bin_dir / "ninja"
    if not (ninja.is_file() and os.access(ninja, os.X_OK)):
        return None
    entries = [entry for entry in os.environ.get("PATH", "").split(os.pathsep) if entry]
    if not entries or Path(entries[0]) != bin_dir:
        os.environ["PATH"] = os.pathsep.join([str(bin_dir), *(e for e in entries if Path(e) != bin_dir)])
    return ninja


def clear_stale_locks() -> None:
    """Before DeepSpeed loads an op: remove stale locks now, so the load builds instead of waiting."""
    watcher = BuildWatcher()
    for _ in range(2):  # a lock must be seen unheld twice
        watcher.check()
        if not watcher.suspect:
            return
        time.sleep(0.2)


@contextlib.contextmanager
def reporting_builds() -> Iterator[None]:
    """Around a call that may build or load a JIT op: the environment's ninja first on PATH, stale locks
    removed, then watched meanwhile."""
    use_environment_ninja()
    with contextlib.suppress(OSError):
        clear_stale_locks()
    done = threading.Event()
    watcher = BuildWatcher()

    def loop() -> None:
        while not done.wait(POLL_SECONDS):
            with contextlib.suppress(OSError):
                watcher.check()

    thread = threading.Thread(target=loop, name="extension-builds", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
