"""A rank's stop handlers cover its whole life (pretrain/distributed/stop_request.py): ignored from the SLURM
entrypoint's exec (pretrain/launch/pin.py) until installed, and installed until the process's os._exit, so a stop
signal at any moment (SLURM's `scancel --signal` reaches the ranks themselves) is never a death by signal (143/138:
a time-limit stop that is not requeued). Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.paths import REPO_ROOT

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def wait_for_file(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None, f"ended early ({proc.returncode}): {proc.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_rank_started_by_the_slurm_entrypoint_outlives_stop_signals_sent_before_its_handler(tmp_path: Path) -> None:
    """The rank says it is up, then waits (as a rank still importing torch would, before the driver's first lines):
    SIGTERM, SIGUSR1 and SIGHUP reach it there. Before, SIGTERM's default action ended it (status -15)."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    code = ("import pathlib, signal, time\n"
            f"pathlib.Path({str(ready)!r}).write_text('')\n"
            f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n"
            "print([signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)])\n")
    proc = subprocess.Popen([sys.executable, "-m", "pretrain.launch.pin", "--", "-c", code], env=ENV, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_file(ready, proc)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        proc.send_signal(signum)
    go.write_text("")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (proc.returncode, err)
    assert out.strip() == "[True, True, True]"


def test_the_processs_own_stop_request_stays_installed_after_the_drivers_uninstall(tmp_path: Path) -> None:
    """What the driver does (pretrain/train.py): the process's request first thing, main()'s request is that one and
    is uninstalled at main()'s end; a SIGTERM after that (its teardown: destroy_process_group, flushes) is noted, and
    the process ends with its own status. Before, the handler was gone and SIGTERM ended it (status -15)."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    code = ("import os, pathlib, time\n"
            "from pretrain.distributed.stop_request import StopRequest\n"
            "StopRequest.for_process()\n"
            "stop = StopRequest.current()\n"
            "stop.uninstall()\n"
            f"pathlib.Path({str(ready)!r}).write_text('')\n"
            f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n"
            "print(stop.signal_name, flush=True)\n"
            "os._exit(0)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_file(ready, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    go.write_text("")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (proc.returncode, err)
    assert out.strip() == "SIGTERM"


def test_a_request_installed_for_one_call_is_uninstalled_as_before() -> None:
    """train() called in a process (a test, a notebook) installs its own request and gives the handlers back."""
    from pretrain.distributed.stop_request import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest()
    request.install()
    assert signal.getsignal(signal.SIGTERM) != before
    request.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
