"""Downtime as a stopwatch sees it (pretrain/metrics/goodput.py): a replayed hang. The fault record is the one the
agent's own judge() writes for a rank whose hang timer ran out (its log, the run folder's `latest`, the shared
history, all real files); the run's clock holds the hung process and the one that recovered; the report's lines are
the report's own. Before, the outage started at the record, so a hang's downtime left out the limit that ran out
(the review's replay: 235 s reported for an 836 s outage) and the report named that time nowhere."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from pretrain.checkpointing.cadence import SAVE_SECONDS_TAG, interval_advice
from pretrain.launch.faults import FaultContext, FaultHistory, RankFailure, judge
from pretrain.metrics.clock import ProcessSpan, read_clock_file
from pretrain.metrics.goodput import account, read_faults
from pretrain.report.records import RunFacts
from pretrain.report.write import downtime_lines, goodput_text
from pretrain.run_folder import CLOCK_FILE, faults_dir, metrics_path

HANG_LIMIT_S = 600.0  # run.hang_timeout_minutes = 10


def replay_hang(run_dir: Path) -> tuple[float, float]:
    """Process 0 steps 1-1050 and freezes in step 1051: its last progress (its last clock write) is at LAST. Its
    timer runs out HANG_LIMIT_S later, the agent asks for its stacks (1 s), kills it and judges it (the record's
    time, now). Process 1 starts 5 s after that and ends its first step 30 s later. Returns (LAST, that first step's
    end): the stopwatch's outage."""
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest").write_text("phase1-step0001000\n")
    log = run_dir / "rank-1.log"
    log.write_text("Thread 0x01 (most recent call first):\n  File \"trainer.py\", line 1 in step\n")
    hang = f"made no progress in {HANG_LIMIT_S / 60:g} min (running but not progressing; run.hang_timeout_minutes)"
    failure = RankFailure(1, "n1", -9, "phase1 step 1051", log, hang, stacks=True, hang_s=HANG_LIMIT_S)
    context = FaultContext("bert-h", 3, run_dir, checkpoints, "./launch.sh pretrain --config run.json")
    record = judge(failure, 0, context, FaultHistory(faults_dir(run_dir)))
    assert record.restarts and record.kind == "hang"
    last = record.time - HANG_LIMIT_S - 1.0
    hung = ProcessSpan(started_at=last - 1100.0, ranks=2, seconds=1100.0, first_step=1, last_step=1050, steps=1050,
                       step_seconds=50.0 + 1049.0, first_step_s=50.0, restart=0, job="bert-h",
                       startup={"first_step": 51.0})
    recovered = ProcessSpan(started_at=record.time + 5.0, ranks=2, seconds=500.0, first_step=1001, last_step=1400,
                            steps=400, step_seconds=30.0 + 399.0, first_step_s=20.0, restart=1, job="bert-h",
                            startup={"first_step": 30.0})
    clock = {"format": 1, "processes": [asdict(hung), asdict(recovered)], "targets": {}}
    (run_dir / CLOCK_FILE).write_text(json.dumps(clock), encoding="utf-8")
    metrics_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    metrics_path(run_dir).write_text(json.dumps({"step": 1000, SAVE_SECONDS_TAG: 4.0}) + "\n")
    return last, record.time + 5.0 + 30.0


def test_a_hangs_downtime_runs_from_its_last_progress_and_its_detection_is_named(tmp_path: Path) -> None:
    last, back = replay_hang(tmp_path)
    spans = read_clock_file(tmp_path / CLOCK_FILE)["processes"]
    costs = account(spans, read_faults(tmp_path))
    stopwatch = back - last  # 600 s limit + 1 s stacks + 5 s restart + 30 s first step
    (outage,) = costs.outages
    # from the timer's start (the record's time less the limit): the stopwatch's outage but the stacks' second
    assert outage.seconds == pytest.approx(stopwatch - 1.0)
    assert costs.downtime_s > HANG_LIMIT_S  # before: 35 s
    assert costs.detection_s == pytest.approx(HANG_LIMIT_S)
    assert costs.recovery_s == pytest.approx(stopwatch - 1.0)

    facts = RunFacts(tmp_path, [], {}, json.loads((tmp_path / CLOCK_FILE).read_text())["processes"], [])
    lines = downtime_lines(costs, facts)
    assert lines[0].startswith("| detection | 600.0 s of the downtime went by before a failure was seen"), lines
    advice = interval_advice(4.0, 2, recovery_seconds=stopwatch - 1.0)
    assert lines[1] == f"| checkpoint interval | {advice} (R: this run's mean downtime per fault) |"
    assert "and a recovery of 635 s each" in advice
    assert "from the failed processes' last progress" in goodput_text(costs)


def test_the_interval_advice_counts_a_recovery_per_failure_and_keeps_the_interval() -> None:
    """R is paid at each failure whatever the interval: the loss grows by R / MTBF, the interval stays."""
    plain, with_r = interval_advice(30.0, 1024), interval_advice(30.0, 1024, recovery_seconds=180.0)
    assert plain.split(" (")[0] == with_r.split(" (")[0] == "save every 21.9 min"
    lost = [float(text.rsplit(": ", 1)[1].split("%")[0]) for text in (plain, with_r)]
    assert lost[1] - lost[0] == pytest.approx(100 * 180.0 / (8 * 3600.0), abs=0.01)


def test_a_death_seen_at_once_has_no_detection(tmp_path: Path) -> None:
    """A rank killed (no timer ran out): its record's detection is 0 and its outage starts at the record."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    log = tmp_path / "rank-1.log"
    log.write_text("")
    context = FaultContext("bert-k", 3, tmp_path, checkpoints, "./launch.sh pretrain --config run.json")
    record = judge(RankFailure(1, "n1", -9, "phase1 step 5", log, hang_s=HANG_LIMIT_S), 0, context,
                   FaultHistory(faults_dir(tmp_path)))
    assert record.detection_s == 0.0
    (fault,) = read_faults(tmp_path)
    assert fault.began == fault.time
