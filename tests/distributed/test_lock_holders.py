"""A JIT build lock whose holder this process cannot see is treated as held: from another pid namespace (a
container sharing the home folder) a live build is invisible, and removing its lock let two ninja builds share one
folder. Such a lock goes only past the age limit, unless the record written beside it when it was seen held
(host, boot, pid namespace, pid, start time) proves its holder dead. Real processes, real pid namespaces
(`unshare`, skipped where the machine allows none) and real records."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.distributed import extension_builds
from pretrain.distributed.holder_records import BOOT_ID, HolderRecord, pid_namespace, provably_dead
from tests.support.launching import child_env
from tests.support.paths import REPO_ROOT

TEN_MINUTES_AGO = time.time() - 600
CHECK = "from pretrain.distributed import extension_builds\nextension_builds.clear_stale_locks()\n"


def hold(lock: Path) -> subprocess.Popen[str]:
    """A build in progress as torch's FileBaton holds it: the file created O_EXCL, its descriptor kept open."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    builder = subprocess.Popen([sys.executable, "-c", f"import os, time\nfd = os.open({str(lock)!r}, os.O_CREAT | "
                                "os.O_EXCL)\nprint('building', flush=True)\ntime.sleep(300)\n"],
                               stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "building"
    os.utime(lock, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))  # well under the 30 min age limit
    return builder


def in_own_pid_namespace(code: str, extensions: Path) -> subprocess.CompletedProcess[str]:
    """`code` run by this interpreter in a new pid namespace with its own /proc, as in a container on this machine
    (root: `unshare --pid`; otherwise a user namespace too, where the machine allows one)."""
    root = [] if os.geteuid() == 0 else ["-r"]
    probe = subprocess.run(["unshare", *root, "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"this machine allows no new pid namespace: {probe.stderr.decode().strip()}")
    env = child_env(PYTHONPATH=str(REPO_ROOT), TORCH_EXTENSIONS_DIR=str(extensions))
    return subprocess.run(["unshare", *root, "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=120)


def end(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait()


def test_a_build_in_another_pid_namespace_keeps_its_lock(tmp_path: Path) -> None:
    """The review's case: a process in a container-like pid namespace, sharing the build folder, looks at a lock a
    live build on the host holds. It sees no holder, yet must leave the lock (and say why)."""
    lock = tmp_path / "fused_adam" / "lock"
    builder = hold(lock)
    try:
        done = in_own_pid_namespace(CHECK, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert lock.exists(), done.stdout
        assert done.stdout.splitlines() == [
            f"extensions: waiting on {lock}: its holder may be a process this one cannot inspect (another container "
            "or namespace on this machine); removed as stale at 30 min of age, or remove it yourself if nothing "
            "is compiling"]
    finally:
        end(builder)


def test_a_lock_recorded_in_another_namespace_or_host_is_left_alone_until_the_age_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    os.utime(lock, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
    here = HolderRecord.of(os.getpid())
    elsewhere = [HolderRecord(here.host, here.boot_id, "pid:[4026532999]", 12345, 1),  # a container beside us
                 HolderRecord("node17", here.boot_id, here.pid_namespace, 12345, 1)]  # another machine
    for holder in elsewhere:
        assert not provably_dead(holder)
        (lock.parent / "lock.holder").write_text(json.dumps({"inode": lock.stat().st_ino,
                                                             "holder": holder.to_dict()}))
        extension_builds.clear_stale_locks()
        assert lock.exists()
        assert capsys.readouterr().out.splitlines() == [
            f"extensions: waiting on {lock}: its holder may be pid 12345 on {holder.host} (pid namespace "
            f"{holder.pid_namespace}); removed as stale at 30 min of age, or remove it yourself if nothing is "
            "compiling"]
    old = time.time() - 31 * 60
    os.utime(lock, (old, old))
    extension_builds.clear_stale_locks()
    assert not lock.exists() and not (lock.parent / "lock.holder").exists()
    assert capsys.readouterr().out.startswith(f"extensions: removed stale lock {lock} (18")


def test_a_killed_build_recorded_in_a_container_is_removed_at_once_there(tmp_path: Path) -> None:
    """Inside a pid namespace of its own the watcher cannot see every process, but a lock it saw held by a build
    of its own namespace carries that build's record: once the build is killed, the record proves it dead."""
    lock = tmp_path / "cpu_adam" / "lock"
    code = (f"import os, subprocess, sys, time\nfrom pathlib import Path\n{CHECK}"
            f"lock = Path({str(lock)!r}); lock.parent.mkdir()\n"
            "builder = subprocess.Popen([sys.executable, '-c', 'import os, time; os.open(%r, os.O_CREAT | os.O_EXCL); "
            "print(1, flush=True); time.sleep(300)' % str(lock)], stdout=subprocess.PIPE, text=True)\n"
            "builder.stdout.readline()\n"
            "extension_builds.BuildWatcher().check()  # sees it held: records the holder\n"
            "print('recorded', open(lock.with_name('lock.holder')).read(), flush=True)\n"
            "builder.kill(); builder.wait()\n"
            "extension_builds.clear_stale_locks()\n"
            "print('left', lock.exists(), lock.with_name('lock.holder').exists())\n")
    done = in_own_pid_namespace(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    record = json.loads(lines[0].removeprefix("recorded "))
    assert record["holder"]["pid_namespace"] not in ("", pid_namespace())  # the container's own namespace
    assert record["holder"]["host"] == socket.gethostname() and record["holder"]["boot_id"] == BOOT_ID.read_text().strip()
    assert lines[1].startswith(f"extensions: removed stale lock {lock} (") and lines[2] == "left False False"


def test_a_record_whose_lock_is_gone_is_cleared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    builder = hold(lock)
    try:
        extension_builds.BuildWatcher().check()
        record = json.loads((lock.parent / "lock.holder").read_text())
        assert record == {"inode": lock.stat().st_ino, "holder": HolderRecord.of(builder.pid).to_dict()}
    finally:
        end(builder)
    lock.unlink()  # as torch's release does at the end of a build
    extension_builds.BuildWatcher().check()
    assert sorted(p.name for p in lock.parent.iterdir()) == []
