"""What a demo user reads: the summary explains each number it prints, and `./launch.sh tensorboard`
takes the README's `runs/demo-*/run` once two demo folders exist.

Before, phase 2's one evaluation printed as "7.088 -> 7.088" (as if nothing had moved), the summary
said nothing of why F1 is near zero at toy scale, why NSP stays at chance or what seq/s counts, and
`./launch.sh tensorboard runs/demo-a/run runs/demo-b/run` handed the second folder to TensorBoard as
an unknown argument.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pretrain.demo import summary
from tests.support.launching import child_env, free_port
from tests.support.paths import REPO_ROOT

RECORDS = [
    {"phase": "phase1", "loss/total": 10.1, "loss/mlm": 9.4, "loss/nsp": 0.70, "perf/seq_per_s": 30.0},
    {"phase": "phase1", "loss/total": 7.9, "loss/mlm": 7.2, "loss/nsp": 0.69, "perf/seq_per_s": 34.0,
     "val/mlm_loss": 7.5},
    {"phase": "phase2", "loss/total": 7.8, "loss/mlm": 7.1, "loss/nsp": 0.69, "perf/seq_per_s": 12.0},
    {"val/mlm_loss": 7.088},  # phase 2's only evaluation, written after its last step
]  # fmt: skip


def test_a_single_value_is_shown_as_one_and_each_number_is_explained() -> None:
    rows = summary.phase_rows(RECORDS)
    values = dict(rows)
    assert values["phase2 val/mlm_loss"] == "7.088 (one evaluation)"
    assert values["phase1 val/mlm_loss"] == "7.500 (one evaluation)"
    assert values["phase2 loss/mlm"] == "7.100 (one step)"
    assert values["phase1 loss/mlm"] == "9.400 -> 7.200"  # two or more: first -> last, as before
    rows += [("SQuAD v1.1 dev", "EM 0.20  F1 3.10  (subset)"), ("SQuAD from random weights", "EM 0.00  F1 2.50")]
    table = summary.render_table(rows)
    notes = table.split("How to read the numbers:\n", 1)[1].splitlines()
    explained = {line.split(": ", 1)[0].strip(): line.split(": ", 1)[1] for line in notes}
    shown_kinds = {ending for ending, _ in summary.READING_NOTES if any(name.endswith(ending) for name, _ in rows)}
    assert set(explained) == shown_kinds  # every kind of number shown, and only those
    assert "0.693 = ln 2 is a coin flip" in explained["loss/nsp"]
    assert "near 0 at toy scale" in explained["SQuAD v1.1 dev"]
    assert "per second over all ranks" in explained["perf/seq_per_s (median)"]
    assert "padding included" in explained["perf/seq_per_s (median)"]
    assert "one evaluation" in explained["val/mlm_loss"]
    assert "How to read" not in summary.render_table([("logs", "/tmp/logs")])  # nothing to explain


def _runs(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=10) as response:
        return json.loads(response.read().decode("utf-8"))


def test_tensorboard_serves_several_run_folders(tmp_path: Path) -> None:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    for name in ("demo-a", "demo-b"):
        writer = EventFileWriter(str(tmp_path / "runs" / name / "run" / "tensorboard"))
        value = Summary.Value(tag="loss/mlm", simple_value=1.0)
        writer.add_event(Event(wall_time=1000.0, step=1, summary=Summary(value=[value])))
        writer.close()
    port = free_port()
    server = subprocess.Popen(
        ["bash", str(REPO_ROOT / "launch.sh"), "tensorboard", "runs/demo-a/run", "runs/demo-b/run",
         "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
        env=child_env(PYTHON=sys.executable), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopped with everything it started
    )  # fmt: skip
    try:
        runs: list[str] = []
        deadline = time.monotonic() + 180
        while len(runs) < 2 and time.monotonic() < deadline:
            try:
                runs = _runs(port)
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None, server.communicate()[0].decode(errors="replace")[-3000:]
            time.sleep(1)
        assert sorted(runs) == ["runs/demo-a/run/tensorboard", "runs/demo-b/run/tensorboard"], runs
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
