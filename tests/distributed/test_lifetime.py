"""A rank's life with real processes, in seconds: the parent-death signal, the run folder lock, stale JIT-build
locks and the first SIGINT. launch.sh's watchdog is tests/launch/test_watchdog.py; the 2-rank runs that use
them through launch.sh are in tests/launch/test_signals.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.distributed import extension_builds
from pretrain.distributed.lifetime import RunFolderBusyError, hold_run_folder, release_run_folder
from pretrain.launch.processes import running
from tests.support.launching import child_env
from tests.support.paths import REPO_ROOT

BOUND_S = 60  # only limits a failing wait


def alive(pid: int) -> bool:
    return running(pid)  # gone, or dead and not yet reaped: not running


def wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + BOUND_S
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def python(code: str, **kwargs: object) -> subprocess.Popen[str]:
    env = child_env(PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True, stdout=subprocess.PIPE, **kwargs)


def test_a_child_with_the_parent_death_signal_ends_when_its_parent_is_killed() -> None:
    parent = python("import subprocess, time\n"
                    "from pretrain.distributed.lifetime import die_with_parent\n"
                    "child = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_parent)\n"
                    "print(child.pid, flush=True)\n"
                    "time.sleep(300)\n")
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.kill()
    parent.wait()
    assert wait_gone([child]) == []


@pytest.mark.parametrize(("launcher", "signum"), [("pretrain.launch.agent", signal.SIGKILL),
                                                  ("torch.distributed.run", signal.SIGTERM)])
def test_a_rank_dies_of_sigkill_with_our_agent_and_checkpoints_when_another_launcher_dies(
        launcher: str, signum: int) -> None:
    """Our agent's death is a node fault: its ranks end at once (SIGKILL, no stop request, no save without the
    agent's timer server). Another launcher's death stops its ranks (SIGTERM: they checkpoint), as before."""
    rank = ("import signal, time\n"
            "from pretrain.distributed.lifetime import die_with_parent\n"
            "from pretrain.distributed.lifetime import parent_death_signal\n"
            "signum = parent_death_signal()\ndie_with_parent(signum)\n"
            "print('death:', signal.Signals(signum).name, flush=True)\ntime.sleep(300)\n")
    parent = python("import subprocess, sys, time\n"  # its command line names the launcher, as the real one's does
                    f"# {launcher}\n"
                    f"child = subprocess.Popen([sys.executable, '-c', {rank!r}], stdout=subprocess.PIPE, text=True)\n"
                    "said = next(line for line in child.stdout if line.startswith('death:'))\n"
                    "print(child.pid, said.split()[1], flush=True)\n"
                    "time.sleep(300)\n")
    pid, name = parent.stdout.readline().split()
    assert name == signal.Signals(signum).name
    parent.kill()
    parent.wait()
    assert wait_gone([int(pid)]) == []


def test_a_run_folder_held_by_a_live_process_is_refused_and_free_once_it_dies(tmp_path: Path) -> None:
    holder = python(f"import time\nfrom pretrain.distributed.lifetime import hold_run_folder\n"
                    f"hold_run_folder({str(tmp_path)!r}); print('held', flush=True); time.sleep(300)\n")
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunFolderBusyError, match=f"in use by a live job \\(pid {holder.pid} on "):
        hold_run_folder(tmp_path)
    holder.kill()
    holder.wait()
    hold_run_folder(tmp_path)  # the kernel dropped the dead holder's lock
    hold_run_folder(tmp_path)  # again in the same process: fine
    release_run_folder(tmp_path)


def plant_lock(root: Path, name: str = "deepspeed_shm_comm") -> Path:
    (root / name).mkdir(parents=True)
    lock = root / name / "lock"
    lock.touch()
    return lock


def test_a_stale_build_lock_is_removed_with_one_line_and_a_held_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = plant_lock(tmp_path)
    # A build in progress, as torch's FileBaton holds it: the file created O_EXCL, its descriptor kept open.
    held = tmp_path / "cpu_adam" / "lock"
    held.parent.mkdir()
    builder = python(f"import os, time\nfd = os.open({str(held)!r}, os.O_CREAT | os.O_EXCL)\n"
                     "print('building', flush=True); time.sleep(300)\n")
    assert builder.stdout.readline().strip() == "building"
    # its age as a compile killed ten minutes ago left it (set just before the check, so the builder's start-up
    # time does not enter the figure)
    os.utime(stale, (time.time() - 600, time.time() - 600))
    extension_builds.clear_stale_locks()
    assert not stale.exists() and held.exists()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"extensions: removed stale lock {stale} (600 s old, no process holds it: left by an "
                     "interrupted compile)"]
    builder.kill()  # killed mid-build: its lock is now stale too
    builder.wait()
    extension_builds.clear_stale_locks()
    assert not held.exists()


def test_first_sigint_asks_for_a_stop_without_a_keyboard_interrupt() -> None:
    from pretrain.distributed.stop_request import StopRequest

    stop = StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between bytecodes
    finally:
        stop.uninstall()
    assert stop.signal_name == "SIGINT" and stop.interrupts == 1
