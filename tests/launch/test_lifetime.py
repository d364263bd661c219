"""Process lifetime with real processes, in seconds: launch.sh's watchdog, the parent-death signal, the run
folder lock, stale JIT-build locks, and metrics kept once per step across a resume. The 2-rank runs that
use them through launch.sh are in test_signals.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.launch import extension_builds
from pretrain.launch.lifetime import RunFolderBusyError, hold_run_folder, release_run_folder
from tests.support.launching import child_env
from tests.support.paths import REPO_ROOT

BOUND_S = 60  # only limits a failing wait


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + BOUND_S
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def python(code: str, **kwargs: object) -> subprocess.Popen[str]:
    env = child_env(PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True, stdout=subprocess.PIPE, **kwargs)


def test_watchdog_stops_the_job_group_once_its_launch_sh_is_killed() -> None:
    stand_in = subprocess.Popen(["sleep", "300"])  # launch.sh
    job = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    watchdog = subprocess.Popen([sys.executable, "-m", "pretrain.launch.lifetime", "watch", str(stand_in.pid), str(job.pid),
                                 "--grace", "5"], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    time.sleep(0.5)
    members = [int(p) for p in subprocess.run(["pgrep", "-g", str(job.pid)], capture_output=True,
                                               text=True).stdout.split()]
    assert len(members) == 3 and watchdog.poll() is None  # still waiting: launch.sh lives
    stand_in.kill()
    stand_in.wait()
    assert watchdog.wait(timeout=BOUND_S) == 0
    job.wait(timeout=BOUND_S)
    assert wait_gone(members) == []
    assert f"launch.sh (pid {stand_in.pid}) is gone: stopping its job (process group {job.pid})" in watchdog.stderr.read()


def test_a_child_with_the_parent_death_signal_ends_when_its_parent_is_killed() -> None:
    parent = python("import subprocess, time\n"
                    "from pretrain.launch.lifetime import die_with_parent\n"
                    "child = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_parent)\n"
                    "print(child.pid, flush=True)\n"
                    "time.sleep(300)\n")
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.kill()
    parent.wait()
    assert wait_gone([child]) == []


def test_a_run_folder_held_by_a_live_process_is_refused_and_free_once_it_dies(tmp_path: Path) -> None:
    holder = python(f"import time\nfrom pretrain.launch.lifetime import hold_run_folder\n"
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


def test_metrics_keep_each_step_once_across_a_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.metrics import MetricsWriter

    first = MetricsWriter(tmp_path, enabled=True)
    for step in range(1, 8):  # checkpoint at step 4, stopped after step 7
        first.scalars(step, {"loss": float(step)})
    first.close()
    resumed = MetricsWriter(tmp_path, enabled=True)
    for step in range(5, 10):  # the resumed run repeats steps 5-7
        resumed.scalars(step, {"loss": 10.0 + step})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 10))
    assert [row["loss"] for row in rows][3:5] == [4.0, 15.0]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [step for step, _ in logged] == list(range(1, 10))
    assert logged[4] == (5, 15.0)


def test_first_sigint_asks_for_a_stop_without_a_keyboard_interrupt() -> None:
    from pretrain.stop_request import StopRequest

    stop = StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between bytecodes
    finally:
        stop.uninstall()
    assert stop.signal_name == "SIGINT" and stop.interrupts == 1
