"""bench/fault_cost.py's quick mode: a real 2-rank CPU run under launch.sh, two ranks killed, both faults healed,
the run stopped by a user's SIGTERM; what it reports adds up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launching import deepspeed_cpu_env
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.multirank


def test_quick_mode_kills_twice_and_splits_each_recovery(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "fault_cost.py"), "--quick", "--out", str(tmp_path)],
                          env=deepspeed_cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "fault_cost.json").read_text())["toolkit"]
    assert (result["status"], result["faults"], result["processes"]) == (0, 2, 3)
    assert 0 < result["productive_s"] < result["wall_s"] and 0 < result["goodput"] < 1
    for parts in result["recoveries"]:
        assert all(parts[part] >= 0 for part in ("stop", "rendezvous", "start-up", "engine build", "checkpoint",
                                                 "first step", "replay")), parts
        assert parts["start-up"] > 0 and parts["first step"] > 0  # marks of the restarted process were written
        steps = sum(parts[p] for p in ("stop", "rendezvous", "start-up", "engine build", "checkpoint", "first step"))
        assert parts["downtime"] == pytest.approx(steps, abs=0.05)  # the parts cover the fault -> first new step
    log = (tmp_path / "toolkit" / "launch.log").read_text()
    assert log.count("launch.sh: fault: rank ") == 2 and "died of SIGKILL" in log
    assert "the shards were hashed at its start" in log  # each restart skipped the hashing its launch did
    assert "largest part of a recovery:" in done.stdout
