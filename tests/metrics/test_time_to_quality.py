"""The run's clock across a stop and a resume, and the quality targets logged once (pretrain/metrics/clock.py,
pretrain/metrics/quality.py, pretrain/metrics/writer.py's MetricsWriter): two writer objects play the two
processes, as a preempted job and its requeued successor would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.config.load import load_config
from pretrain.errors import ConfigError
from pretrain.metrics.clock import RunClock
from pretrain.metrics.quality import QualityPlan, QualitySection, TimeToQuality
from pretrain.metrics.writer import MetricsWriter
from pretrain.run_folder import CLOCK_FILE
from tests.support.pretrain_fixtures import REPO_ROOT


def settings(run_dir: Path, ranks: int, marks: tuple[float, ...] = (0.3, 0.5, 0.72)) -> QualityPlan:
    return QualityPlan(run_dir, ranks, QualitySection(list(marks)))


def test_the_clock_adds_the_processes_and_forgets_targets_the_resume_repeats(tmp_path: Path) -> None:
    first = TimeToQuality(settings(tmp_path, ranks=2), RunClock(tmp_path, 2, started=100.0))
    first.begin(0)
    assert first.observe(5, {"loss/mlm": 3.0}, samples=320, now=130.0) == {}, "a training row gets no time/*"
    at_10 = first.observe(10, {"val/mlm_acc": 0.35}, samples=640, now=160.0)
    assert at_10["time/wall_s"] == pytest.approx(60.0) and at_10["time/samples"] == 640
    assert at_10["time/device_hours"] == pytest.approx(2 * 60.0 / 3600)
    assert at_10["target/mlm_acc_0.3/wall_s"] == pytest.approx(60.0)
    assert at_10["target/mlm_acc_0.3/samples"] == 640 and "target/mlm_acc_0.5/wall_s" not in at_10
    at_20 = first.observe(20, {"val/mlm_acc": 0.52}, samples=1280, now=220.0)
    assert "target/mlm_acc_0.3/wall_s" not in at_20, "a mark is logged once"
    assert at_20["target/mlm_acc_0.5/device_hours"] == pytest.approx(2 * 120.0 / 3600)
    first.clock.close(now=230.0)  # the process ends (its last checkpoint was at step 15)

    # The requeued job: 4 ranks, resumes from the step-15 checkpoint, so it logs from step 16 on.
    second = TimeToQuality(settings(tmp_path, ranks=4), RunClock(tmp_path, 4, started=1000.0))
    second.begin(16)
    assert set(second.clock.targets) == {"0.3"}, "0.5 was reached at step 20, which the resume repeats"
    again = second.observe(20, {"val/mlm_acc": 0.51}, samples=1280, now=1010.0)
    assert again["time/wall_s"] == pytest.approx(130.0 + 10.0), "earlier processes' seconds + this one's"
    assert again["time/device_hours"] == pytest.approx((2 * 130.0 + 4 * 10.0) / 3600)
    assert again["target/mlm_acc_0.5/wall_s"] == pytest.approx(140.0) and "target/mlm_acc_0.3/wall_s" not in again
    second.clock.close(now=1020.0)

    saved = json.loads((tmp_path / CLOCK_FILE).read_text())
    assert [(p["ranks"], p["first_step"], p["last_step"]) for p in saved["processes"]] == [(2, 0, 20), (4, 16, 20)]
    assert [p["seconds"] for p in saved["processes"]] == pytest.approx([130.0, 20.0])
    assert {key: mark["step"] for key, mark in saved["targets"].items()} == {"0.3": 10, "0.5": 20}
    assert saved["targets"]["0.5"]["device_hours"] == pytest.approx((2 * 130.0 + 4 * 10.0) / 3600)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]


def test_each_target_is_in_metrics_jsonl_and_tensorboard_once_across_a_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accuracy = {2: 0.35, 4: 0.55, 6: 0.75}  # the resumed run reaches the same marks at the same steps
    first = MetricsWriter(tmp_path / "tensorboard", enabled=True, quality=settings(tmp_path, ranks=2))
    for step in (1, 2, 3, 4):  # killed after step 4; its last checkpoint was at step 2
        values = {"loss/mlm": 5.0 - step, **({"val/mlm_acc": accuracy[step]} if step in accuracy else {})}
        first.scalars(step, values, extra={"phase": "phase1", "samples": step * 64})
    first.close()
    seconds_before = json.loads((tmp_path / CLOCK_FILE).read_text())["processes"][0]["seconds"]
    second = MetricsWriter(tmp_path / "tensorboard", enabled=True, quality=settings(tmp_path, ranks=2))
    for step in (3, 4, 5, 6):
        values = {"loss/mlm": 5.0 - step, **({"val/mlm_acc": accuracy[step]} if step in accuracy else {})}
        second.scalars(step, values, extra={"phase": "phase1", "samples": step * 64})
    second.close()

    logged = rows(tmp_path)
    assert [row["step"] for row in logged] == [1, 2, 3, 4, 5, 6], "the repeated steps' rows are replaced"
    assert all("wall_s" in row for row in logged) and all(row["wall_s"] >= seconds_before for row in logged[2:])
    reached = {tag: [row["step"] for row in logged if tag in row]
               for tag in ("target/mlm_acc_0.3/wall_s", "target/mlm_acc_0.5/wall_s", "target/mlm_acc_0.72/samples")}
    assert reached == {"target/mlm_acc_0.3/wall_s": [2], "target/mlm_acc_0.5/wall_s": [4],
                       "target/mlm_acc_0.72/samples": [6]}
    assert [row["time/samples"] for row in logged if "time/samples" in row] == [128, 256, 384]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag, steps in reached.items():
        assert [event.step for event in events.Scalars(tag)] == steps, tag
    clock = json.loads((tmp_path / CLOCK_FILE).read_text())
    assert [p["first_step"] for p in clock["processes"]] == [1, 3]
    assert sorted(clock["targets"]) == ["0.3", "0.5", "0.72"]


def test_a_writer_without_quality_settings_writes_no_clock(tmp_path: Path) -> None:
    plain = MetricsWriter(tmp_path / "tensorboard", enabled=True)
    plain.scalars(1, {"val/mlm_acc": 0.9})
    plain.close()
    assert "wall_s" not in rows(tmp_path)[0] and not (tmp_path / CLOCK_FILE).exists()


@pytest.mark.parametrize(("marks", "message"), [
    ("[0.5, 1.5]", r"logging.quality_targets\[1\]: 1.5 is not a masked-LM accuracy in \(0, 1\]"),
    ("[0.5, 0.50]", "logging.quality_targets: .* names a mark twice"),
    ('["high"]', r"logging.quality_targets\[0\]: expected float"),
])
def test_bad_quality_targets_name_the_key(tmp_path: Path, marks: str, message: str) -> None:
    run_json = REPO_ROOT / "pretrain" / "demo" / "demo_run.json"
    with pytest.raises(ConfigError, match=message):
        config = load_config(run_json, [f"--logging.quality_targets={marks}"])
        QualityPlan(tmp_path, 1, config.logging)  # what the driver builds on every rank


def test_a_damaged_clock_file_is_set_aside_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / CLOCK_FILE).write_text('{"processes": [{"ranks": "two"}]')
    clock = RunClock(tmp_path, 1, started=0.0)
    assert clock.earlier == [] and (tmp_path / (CLOCK_FILE + ".damaged")).is_file()
    assert "set aside" in capsys.readouterr().out
