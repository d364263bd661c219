"""TensorBoard as a user sees it: the real server on a finished 2-rank run, read over its HTTP interface.

`./launch.sh pretrain --cpu --gpus 2` trains a tiny run (ZeRO-2 + ExactLamb over gloo), then
`./launch.sh tensorboard RUN_DIR --host 127.0.0.1 --port P` serves it; the test asks the server for the
data a browser's dashboard would draw (loss, lr, LAMB trust ratios, throughput, validation) and checks
it equals what the driver logged in metrics.jsonl, then stops the server by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.support.launching import child_env, free_port
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

SCALARS = (
    "loss/mlm",
    "loss/total",
    "lr",
    "lamb/trust_ratio_min",
    "lamb/trust_ratio_mean",
    "lamb/trust_ratio_max",
    "perf/seq_per_s",
    "perf/tokens_per_s",
    "grad_norm",
    "val/mlm_loss",
)


def get_json(port: int, path: str, **query: str) -> object:
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode("utf-8"))


def children(pid: int) -> list[int]:
    """The direct children of `pid` (launch.sh runs TensorBoard as its child)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny two-phase run on 2 CPU ranks through launch.sh, as the README's quick start does."""
    root = tmp_path_factory.mktemp("tb_run")
    shards = build_shards(root / "shards")
    run_dir = root / "run"
    config = tiny_run_config(root / "tiny.json", shards, run_dir, phase1=6, phase2=3)
    env = child_env(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "launch.sh"), "pretrain", "--cpu", "--gpus", "2", "--master-port",
         str(free_port()), "--config", str(config)],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


@pytest.mark.multirank
def test_tensorboard_serves_what_the_driver_logged(finished_run: Path) -> None:
    logged = [
        json.loads(line) for line in (finished_run / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    ]
    port = free_port()
    server = subprocess.Popen(
        ["bash", str(REPO_ROOT / "launch.sh"), "tensorboard", str(finished_run), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        env=child_env(PYTHON=sys.executable), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, so nothing it starts can outlive the test
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        tags: dict = {}
        while time.monotonic() < deadline:  # the server loads event files in the background
            try:
                tags = get_json(port, "/data/plugin/scalars/tags")  # type: ignore[assignment]
                if tags and all(tag in tags.get("tensorboard", {}) for tag in SCALARS):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None, f"tensorboard exited {server.returncode}"
            time.sleep(0.2)
        assert "tensorboard" in get_json(port, "/data/runs")  # type: ignore[operator]
        missing = [tag for tag in SCALARS if tag not in tags.get("tensorboard", {})]
        assert not missing, (
            f"scalars the dashboard lacks: {missing}; it has {sorted(tags.get('tensorboard', {}))}"
        )

        for tag in SCALARS:
            served = get_json(port, "/data/plugin/scalars/scalars", run="tensorboard", tag=tag)
            expected = {r["step"]: r[tag] for r in logged if tag in r}
            # [wall_time, step, value] per point; TensorBoard stores float32
            got = {int(step): value for _, step, value in served}  # type: ignore[union-attr]
            assert sorted(got) == sorted(expected), tag
            for step, value in expected.items():
                assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-12), (tag, step)

        # what the curves show: 6 + 3 steps, each phase's lr peaking at its own base lr (5e-3, then 3e-3),
        # a falling MLM loss
        steps = [
            step
            for _, step, _ in get_json(
                port, "/data/plugin/scalars/scalars", run="tensorboard", tag="loss/mlm"
            )
        ]  # type: ignore[union-attr]
        assert steps == list(range(1, 10))
        served_lr = get_json(port, "/data/plugin/scalars/scalars", run="tensorboard", tag="lr")
        lr = [v for _, _, v in served_lr]  # type: ignore[union-attr]
        assert max(lr[:6]) == pytest.approx(5e-3) and max(lr[6:]) == pytest.approx(3e-3) and min(lr) >= 0
        mlm = [
            v for _, _, v in get_json(port, "/data/plugin/scalars/scalars", run="tensorboard", tag="loss/mlm")
        ]  # type: ignore[union-attr]
        assert sum(mlm[4:6]) < sum(mlm[:2]), mlm
        ratios = get_json(
            port, "/data/plugin/scalars/scalars", run="tensorboard", tag="lamb/trust_ratio_mean"
        )
        assert all(0 < v < 1e3 for _, _, v in ratios)  # type: ignore[union-attr]
        assert all(
            v > 0
            for _, _, v in get_json(
                port, "/data/plugin/scalars/scalars", run="tensorboard", tag="perf/seq_per_s"
            )
        )  # type: ignore[union-attr]
        histograms = get_json(port, "/data/plugin/histograms/tags")
        assert "lamb/trust_ratio" in histograms.get("tensorboard", {})  # type: ignore[union-attr]
        served = get_json(
            port, "/data/plugin/histograms/histograms", run="tensorboard", tag="lamb/trust_ratio"
        )
        assert len(served) == 9  # type: ignore[arg-type]  one histogram per optimizer step
    finally:
        tensorboard = children(server.pid)  # launch.sh -> python -m tensorboard.main
        for pid in tensorboard:
            os.kill(pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)  # the group this test created, nothing else
                server.wait(timeout=30)
    assert tensorboard, "launch.sh did not start TensorBoard as its child"
    with pytest.raises(urllib.error.URLError):
        get_json(port, "/data/runs")
