"""bench/large_batch.py in --quick mode: the sweep's shape, equal samples and evaluation points, the
paper's rules, falling losses, resume and refusals. The outcome (which optimizer wins) is not asserted:
that is what docs/large_batch.md reports from the full sweep."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launching import child_env
from tests.support.paths import REPO_ROOT

BENCH = REPO_ROOT / "bench" / "large_batch.py"


def bench(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--samples", "1000"], "--samples 1000: must be a multiple of the largest batch 256 x 8"),
        (["--multipliers", "4,1"], "--multipliers (4, 1): must be increasing"),
        (["--warmup-fraction-base", "0.1"], "--warmup-fraction-base 0.1: x 16"),
        (["--lamb-lr", "0"], "--lamb-lr 0.0: must be > 0"),
        (["--ranks", "3"], "--ranks 3: the base batch 16 is not divisible by it"),
    ],
)
def test_bad_settings_stop_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    proc = bench(*args, "--work", str(tmp_path / "work"), "--results", str(tmp_path / "r.json"), timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "r.json").exists()


@pytest.mark.shared_data
def test_quick_sweep(shared_data: Path, tmp_path: Path) -> None:
    results_path, plot_path = tmp_path / "lb.json", tmp_path / "lb.png"
    common = [
        "--quick",
        "--shared-data",
        str(shared_data),
        "--work",
        str(tmp_path / "work"),
        "--results",
        str(results_path),
        "--plot",
        str(plot_path),
    ]
    proc = bench(*common, "--ranks", "1", "--parallel", "2")  # as the full sweep runs: one process per run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(results_path.read_text(encoding="utf-8"))
    s, runs = data["settings"], data["runs"]
    assert "--quick" in data["command"]
    expected = {
        f"{name}-k{k}-x{f:g}"
        for name in ("lamb", "adamw")
        for k in s["multipliers"]
        for f in s[f"{name}_grid"]
    }
    assert set(runs) == expected and s["lamb_grid"] == [1.0]  # --quick: the rule's LAMB only
    assert len(expected) == len(s["multipliers"]) * (1 + len(s["adamw_grid"]))
    val_points = {tuple(p[0] for p in r["val_curve"]) for r in runs.values()}
    assert val_points == {tuple(s["samples"] * (i + 1) // s["val_points"] for i in range(s["val_points"]))}
    assert len({r["warmup_steps"] for r in runs.values()}) == 1, (
        "the paper's warmup: the same steps at every batch"
    )
    for r in runs.values():
        k = r["multiplier"]
        assert (
            r["status"] == "ok"
            and r["batch"] == s["base_batch"] * k
            and r["steps"] * r["batch"] == s["samples"]
        )
        base = s["lamb_lr"] if r["optimizer"] == "lamb" else s["adamw_lr"] * r["lr_factor"]
        assert r["lr"] == pytest.approx(base * math.sqrt(k))
        # every run learned: the held-out loss and the last steps' training loss are below the first step's
        assert r["final_val_mlm_loss"] < r["first_train_mlm_loss"], r
        assert r["last_train_mlm_loss"] < r["first_train_mlm_loss"], r
    # the table: one row per batch x optimizer, then AdamW's grid with one row per batch
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "B) |" in line]
    assert len(rows) == 2 * len(s["multipliers"])
    assert [row.split("|")[4].strip().split()[0] for row in rows] == ["LAMB", "AdamW"] * len(s["multipliers"])
    grid = [line for line in proc.stdout.splitlines() if line.startswith(f"| {s['base_batch']} |")]
    assert len(grid) == 1 and grid[0].count("**") == 2  # the best grid point is marked
    assert sum(
        line.startswith("batch ") and "loss LAMB / best AdamW" in line for line in proc.stdout.splitlines()
    ) == len(s["multipliers"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot_path.stat().st_size > 10_000

    # resume: every run is in the file, so nothing trains and the file is left as it was
    before = results_path.read_bytes()
    again = bench(*common, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"{len(expected)} runs already in {results_path}, 0 to run" in again.stdout
    assert results_path.read_bytes() == before
    # the same file with other settings is refused rather than mixed
    other = bench(*common, "--samples", "2048", timeout=300)
    assert other.returncode != 0 and "made with other settings (differ: samples)" in other.stderr
    assert results_path.read_bytes() == before
