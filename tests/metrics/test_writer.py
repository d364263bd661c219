"""The metrics writer: each step kept once in metrics.jsonl and TensorBoard across a stop and resume."""

from __future__ import annotations

import json
from pathlib import Path


def test_metrics_keep_each_step_once_across_a_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.metrics.writer import MetricsWriter

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
