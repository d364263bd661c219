"""bench/fault_cost.py's quick mode: a real 2-rank CPU run under launch.sh, two ranks killed, both faults healed,
the run stopped by a user's SIGTERM; what it reports adds up, and its goodput is the run's own figure: the one
`./launch.sh report` writes and the one the run logged with its last step (pretrain/metrics/goodput.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.metrics.clock import read_clock_file
from pretrain.metrics.goodput import account, read_faults
from pretrain.run_folder import CLOCK_FILE, metrics_path
from tests.support.launching import deepspeed_cpu_env
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.multirank


def test_quick_mode_kills_twice_and_splits_each_recovery(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "fault_cost.py"), "--quick", "--out", str(tmp_path)],
                          env=deepspeed_cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "fault_cost.json").read_text())["toolkit"]
    assert (result["status"], result["faults"], result["faults_recorded"], result["processes"]) == (0, 2, 2, 3)
    assert 0 < result["productive_s"] < result["wall_s"] <= result["stopwatch_wall_s"] and 0 < result["goodput"] < 1
    for parts in result["recoveries"]:
        assert all(parts[part] >= 0 for part in ("stop", "rendezvous", "start-up", "engine build", "checkpoint",
                                                 "first step", "replay")), parts
        assert parts["start-up"] > 0 and parts["first step"] > 0  # marks of the restarted process were written
        steps = sum(parts[p] for p in ("stop", "rendezvous", "start-up", "engine build", "checkpoint", "first step"))
        assert parts["downtime"] == pytest.approx(steps, abs=0.05)  # the parts cover the fault -> first new step
        # the run's downtime runs from the agent's record of the fault: the stopwatch's from the kill, less the
        # moment the agent took to see the death and judge it
        assert 0 <= parts["downtime"] - parts["run downtime"] < 3.0, parts
    log = (tmp_path / "toolkit" / "launch.log").read_text()
    assert log.count("launch.sh: fault: rank ") == 2 and "died of SIGKILL" in log
    assert "the shards were hashed at its start" in log  # each restart skipped the hashing its launch did
    assert "largest part of a recovery:" in done.stdout

    run_dir = tmp_path / "toolkit" / "run"
    spans, faults = read_clock_file(run_dir / CLOCK_FILE)["processes"], read_faults(run_dir)
    assert result["goodput"] == account(spans, faults).goodput
    report = subprocess.run([sys.executable, "-m", "pretrain.report", str(run_dir), "--no-model-cards"],
                            env=deepspeed_cpu_env(), capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert f"| goodput | {result['goodput']:.1%} (" in (run_dir / "report.md").read_text()
    # The run's own figure, logged with its last step: the same definition over the clock as it stood then (the
    # last process's seconds up to that row; after it came the stop's checkpoint and the exit).
    rows = [json.loads(line) for line in metrics_path(run_dir).read_text().splitlines()]
    last = [row for row in rows if "time/goodput" in row][-1]
    spans[-1].seconds = last["wall_s"] - sum(span.seconds for span in spans[:-1])
    assert account(spans, faults).goodput == pytest.approx(last["time/goodput"], abs=1e-4)
