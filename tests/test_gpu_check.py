"""bench/gpu_check.sh --smoke: the prepared GPU check runs end to end on CPU (CI has no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_util import child_env
from tests.scripts.pretrain_fixtures import REPO_ROOT


def test_gpu_check_smoke_prints_the_table_and_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {k: v for k, v in child_env().items() if k != "DS_ACCELERATOR"}
    env["PYTHON"] = sys.executable
    done = subprocess.run([str(REPO_ROOT / "bench" / "gpu_check.sh"), "--smoke", "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| model | seq | micro | inst/row |" in done.stdout and "| LAMB step |" in done.stdout
    rows = json.loads(out.read_text())
    train = {(r["seq_len"], r["instances_per_row"]): r for r in rows["train"]}
    assert set(train) == {(32, 1), (64, 1), (64, 2)}
    for row in train.values():
        assert row["seq_per_s"] > 0 and row["tflops"] > 0 and row["precision"] == "fp32"
        assert row["tokens_per_s"] == pytest.approx(row["seq_per_s"] * row["seq_len"] / row["instances_per_row"])
    # the packed row counts two instances per row
    assert train[(64, 2)]["seq_per_s"] == pytest.approx(2 * train[(64, 2)]["micro_batch"] * 1e3 / train[(64, 2)]["step_ms"])
    (lamb,) = rows["lamb"]
    assert lamb["variant"] == "reference" and lamb["step_ms"] > 0 and lamb["floor_ms"] > 0


def test_gpu_check_names_missing_wheels_and_installs_nothing(tmp_path: Path) -> None:
    fake = tmp_path / "python3"
    # a "python" without the packages: the script must stop with the list, before any work
    fake.write_text("#!/bin/sh\nexec /usr/bin/env python3 -S -I \"$@\"\n")
    fake.chmod(0o755)
    done = subprocess.run([str(REPO_ROOT / "bench" / "gpu_check.sh"), "--smoke"], cwd=tmp_path,
                          env=child_env(PYTHON=str(fake)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "missing Python packages" in done.stderr and "deepspeed" in done.stderr
