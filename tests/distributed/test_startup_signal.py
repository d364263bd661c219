"""A stop signal during start-up, from the driver's first line on, is not fatal: the run stops at its first step
with a checkpoint.

SLURM's time-limit signal (`--signal=B:USR1@600`) reaches a job that started less than ten minutes
before its limit while rank 0 may still be hashing shards; before, the default action of SIGUSR1
killed the ranks and the job ended without a checkpoint or a requeue.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from pretrain.launch.processes import catches
from tests.support.launching import deepspeed_cpu_env
from tests.support.pretrain_fixtures import REPO_ROOT, build_shards, tiny_run_config


def test_usr1_during_startup_stops_at_the_first_step_with_a_checkpoint(tmp_path: Path) -> None:
    shards = build_shards(tmp_path / "shards", train=32, val=8)
    config = tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run", phase1=50, phase2=2)
    proc = subprocess.Popen([sys.executable, "-u", "-m", "pretrain.train", "--config", str(config)],
                            cwd=REPO_ROOT, env=deepspeed_cpu_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # The driver installs its handlers first thing, before it imports torch (pretrain/train.py): the signal comes
    # the moment it can be caught, while the heavy imports still run, long before the process group starts.
    deadline = time.monotonic() + 240
    while not catches(proc.pid, signal.SIGUSR1):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=240)
    assert "shm_comm_op" in output  # the process group started after the signal: it came during the imports
    assert proc.returncode == 0, output[-3000:]
    assert "done: SIGUSR1" in output, output[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    tag = (checkpoints / "latest").read_text()
    state = json.loads((checkpoints / tag / "trainer_state.json").read_text())
    assert state["phase"] == "phase1" and 1 <= state["step"] < 50 and not state["complete"]
