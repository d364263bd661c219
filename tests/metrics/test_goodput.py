"""What a run's time went to (pretrain/metrics/goodput.py), counted by hand: the run's clock and the agents' fault
records are written as real files into a run folder, and read back the way the run, the report and the benchmark
read them."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from pretrain.launch.faults import FaultHistory, FaultRecord
from pretrain.metrics.clock import ProcessSpan, RunClock, read_clock_file
from pretrain.metrics.goodput import Accounting, account, faults_of, read_faults
from pretrain.metrics.quality import GOODPUT_TAG, QualityPlan, QualitySection, TimeToQuality
from pretrain.metrics.writer import MetricsWriter
from pretrain.report.write import goodput_text, process_lines, read_run
from pretrain.run_folder import CLOCK_FILE, faults_dir

T0 = 1_700_000_000.0


def write_clock(run_dir: Path, spans: list[ProcessSpan]) -> None:
    data = {"format": 1, "processes": [asdict(span) for span in spans], "targets": {}}
    (run_dir / CLOCK_FILE).write_text(json.dumps(data), encoding="utf-8")


def record(when: float, job: str, restart: int, step: str | None, checkpoint: str | None, host: str = "n1",
           restarts: bool = True, order: int = 3, rank: int = 1) -> FaultRecord:
    """A fault record as an agent writes it (only the fields the accounting reads differ between these)."""
    return FaultRecord(when, job, host, restart, "signal", rank, "died of SIGKILL", step, None, checkpoint, restarts,
                       0 if restarts else 1, order, f"rank {rank} died of SIGKILL", when - 0.1)


def accounted(run_dir: Path) -> Accounting:
    return account(read_clock_file(run_dir / CLOCK_FILE)["processes"], read_faults(run_dir))


def test_the_worked_example_two_gpu_processes_with_a_150_s_compile_step(tmp_path: Path) -> None:
    """Launch bert-a on 16 GPUs; step 1 of each process compiles for 150 s, every later step takes 1 s (saves and
    validations take no time here, for round numbers).

    A starts at T0: the plan at 100 s, the engine at 250 s, step 1 done at 400 s, step k at 400 + (k - 1). It
    commits checkpoints at steps 500 and 1000 (the clock is written with each), validates every 200 steps (the
    clock again), and writes the clock at least once a minute: its last write is step 1200's validation, at 1599 s.
    Rank 1 is killed 40 s later, during step 1241; the agent of n1 judges it at 1639 s, n2's agent (whose rank
    died of the lost peer: a victim) 0.4 s later. Both records are one fault.
    B, the agent's restart 1, starts 45 s after the fault (stopping the old ranks, the rendezvous, the spawn), at
    1684 s: the plan at 100 s, the engine at 250 s, the checkpoint of step 1000 loaded at 400 s, step 1001 done at
    550 s; it trains to step 13000 and ends 1 s after it, at 1684 + 12550 s.

    By hand:
        wall        A 1639 s (to the fault: its last write was 40 s earlier) + 45 s restart + B 12550 s = 14234 s
        productive  A's steps 2-1000 (999 s; 1001-1240 were done again by B) + B's 1002-13000 (11999 s) = 12998 s
        goodput     12998 / 14234 = 91.3 %
        start-up    A 400 s + B 550 s (each with its 150 s step 1) = 950 s
        downtime    the fault at 1639 s -> B's first step at 1684 + 550 = 2234 s: 595 s
        redone      1241 - 1 - 1000 = 240 steps (the clock had logged 200 of them)
    and 14234 = 12998 productive + 950 start-up + 240 redone + 45 restart + 1 at the end.
    The accounting before this one read 93.3 %: it counted both compile steps as productive, showed an 85 s "gap"
    (from A's last write to B's start) instead of the 595 s downtime, and 200 steps redone instead of 240."""
    a = ProcessSpan(started_at=T0, ranks=16, seconds=1599.0, first_step=1, last_step=1200, steps=1200,
                    step_seconds=150.0 + 1199.0, first_step_s=150.0, restart=0, job="bert-a",
                    startup={"planned": 100.0, "engine_built": 250.0, "first_step": 400.0})
    b = ProcessSpan(started_at=T0 + 1684.0, ranks=16, seconds=12550.0, first_step=1001, last_step=13000, steps=12000,
                    step_seconds=150.0 + 11999.0, first_step_s=150.0, restart=1, job="bert-a",
                    startup={"planned": 100.0, "engine_built": 250.0, "checkpoint_loaded": 400.0, "first_step": 550.0})
    write_clock(tmp_path, [a, b])
    history = FaultHistory(faults_dir(tmp_path))
    history.add(record(T0 + 1639.0, "bert-a", 0, "phase1 step 1241", "phase1-step0001000"))
    history.add(record(T0 + 1639.4, "bert-a", 0, "phase1 step 1241", "phase1-step0001000", host="n2", order=5,
                       rank=9))

    costs = accounted(tmp_path)
    assert costs.wall_s == pytest.approx(14234.0)
    assert costs.productive_s == pytest.approx(12998.0)
    assert costs.goodput == pytest.approx(12998.0 / 14234.0) and f"{costs.goodput:.1%}" == "91.3%"
    assert costs.startup_s == pytest.approx(950.0)
    assert costs.downtime_s == pytest.approx(595.0)
    assert costs.redone_steps == 240 and [cost.redone_steps for cost in costs.processes] == [240, 0]
    assert len(costs.faults) == 1 and costs.faults[0].time == T0 + 1639.0, "one fault, from its first record"
    assert costs.faults[0].steps_past_checkpoint == 240 and costs.launch_ends == ()
    outage = costs.outage_before(1)
    assert outage is not None and outage.seconds == pytest.approx(595.0) and costs.outage_before(0) is None
    assert costs.processes[1].after == costs.faults[0] == costs.processes[0].ended_by

    # ./launch.sh report says the same, from the same folder, under the same names
    facts = read_run(tmp_path, None)
    assert goodput_text(costs).startswith("91.3% (productive step time over wall time: 12,998.0 s of 14,234.0 s; "
                                          "start-up 950.0 s, step 1 of each process included; 1 fault(s) in the "
                                          "fault records, downtime 595.0 s")
    rows = process_lines(facts)[2:]
    assert rows[0].endswith("| 100.0 / 250.0 / n/a / 400.0 |  | 240 | start |")
    assert rows[1].endswith("| 100.0 / 250.0 / 400.0 / 550.0 | 595.0 | 0 | restart 1 after a fault |")


def test_faults_come_from_the_records_one_per_launch_and_restart(tmp_path: Path) -> None:
    """Launch bert-a, then a person's rerun (launch bert-b) the next day; 1 s steps, step 1 of each process 10 s.

        P0  restart 0, starts at 0: step 1 done at 30 s, steps 1-100, checkpoint at 100 (its last write, 129 s);
            killed during step 106, judged at 135 s (two nodes' records: one fault)
        P1  restart 1, starts at 140 s and is killed during its start-up at 160 s: no clock entry, one record
        P2  restart 2, starts at 165 s: step 101 done at 190 s, steps to 200, ends at 290 s when a node joins
        P3  restart 3 (the agent's restart for the new node: no fault record), starts at 300 s: step 201 done at
            320 s, steps to 250 (checkpoint, its last write at 369 s); fails in step 260 at 400 s with no restart
            left: the launch ends
        P4  launch bert-b, a day later: steps 251-300 from the checkpoint of step 250, in 70 s

    wall: 0-400 s for launch a (its processes, the restarts between them, P1's lost start-up: all of it) + 70 s;
    the day between the launches is not counted. productive: 99 + 99 + 49 + 49 = 296 s. downtime: one outage of
    two faults, 135 s -> 190 s = 55 s; the fault that ended launch a costs no downtime, and the rerun's wait is
    left out (the report says so). Redone: P0's steps 101-105 (5) and P3's 251-259 (9), none of them on the
    clock. Faults: 3."""
    spans = [
        ProcessSpan(started_at=0.0, ranks=2, seconds=129.0, first_step=1, last_step=100, steps=100,
                    step_seconds=10.0 + 99.0, first_step_s=10.0, job="bert-a", startup={"first_step": 30.0}),
        ProcessSpan(started_at=165.0, ranks=2, seconds=125.0, first_step=101, last_step=200, steps=100,
                    step_seconds=10.0 + 99.0, first_step_s=10.0, restart=2, job="bert-a",
                    startup={"first_step": 25.0}),
        ProcessSpan(started_at=300.0, ranks=4, seconds=69.0, first_step=201, last_step=250, steps=50,
                    step_seconds=10.0 + 49.0, first_step_s=10.0, restart=3, job="bert-a",
                    startup={"first_step": 20.0}),
        ProcessSpan(started_at=90_000.0, ranks=4, seconds=70.0, first_step=251, last_step=300, steps=50,
                    step_seconds=10.0 + 49.0, first_step_s=10.0, job="bert-b", startup={"first_step": 20.0}),
    ]
    write_clock(tmp_path, spans)
    history = FaultHistory(faults_dir(tmp_path))
    for host in ("n1", "n2"):
        history.add(record(135.0, "bert-a", 0, "phase1 step 106", "phase1-step0000100", host=host))
    history.add(record(160.0, "bert-a", 1, "start-up", "phase1-step0000100"))
    history.add(record(400.0, "bert-a", 3, "phase1 step 260", "phase1-step0000250", restarts=False))
    (faults_dir(tmp_path) / "not-ours.json").write_text("{", encoding="utf-8")

    costs = accounted(tmp_path)
    assert [(f.job, f.restart, f.restarted) for f in costs.faults] == [
        ("bert-a", 0, True), ("bert-a", 1, True), ("bert-a", 3, False)]
    assert costs.wall_s == pytest.approx(470.0) and costs.productive_s == pytest.approx(296.0)
    assert costs.downtime_s == pytest.approx(55.0) and len(costs.outages) == 2
    assert [len(o.faults) for o in costs.outages] == [2, 1] and costs.outage_before(1) == costs.outages[0]
    assert costs.redone_steps == 14 and [c.redone_steps for c in costs.processes] == [5, 0, 9, 0]
    assert costs.startup_s == pytest.approx(95.0) and len(costs.launch_ends) == 1
    assert [c.after is not None for c in costs.processes] == [False, True, False, False]
    assert [c.end for c in costs.processes] == [135.0, 290.0, 400.0, 90_070.0]
    kinds = [line.rsplit("|", 2)[1].strip() for line in process_lines(read_run(tmp_path, None))[2:]]
    assert kinds == ["start", "restart 2 after a fault", "restart 3, no fault recorded (a node joined)", "resume"]
    assert goodput_text(costs).endswith("1 fault(s) ended a launch: the time until the run was launched again is "
                                        "not counted")


def test_a_restart_that_dies_starting_with_no_restart_left_is_down_until_its_fault(tmp_path: Path) -> None:
    """P0: step 1 done at 30 s (10 s of it), steps to 20, last write at 49 s, killed during step 25 (judged at 55 s);
    its restart dies in its start-up, judged at 80 s with no restart left, and writes no clock. Wall 0-80 s,
    productive 19 s, one outage of 25 s from the first fault to the last sign of the launch, two faults, one of
    which ended the launch; nothing redone yet (no process resumed)."""
    write_clock(tmp_path, [ProcessSpan(started_at=0.0, ranks=2, seconds=49.0, first_step=1, last_step=20, steps=20,
                                       step_seconds=10.0 + 19.0, first_step_s=10.0, job="j",
                                       startup={"first_step": 30.0})])
    history = FaultHistory(faults_dir(tmp_path))
    history.add(record(55.0, "j", 0, "phase1 step 25", "phase1-step0000020"))
    history.add(record(80.0, "j", 1, "start-up", "phase1-step0000020", restarts=False))
    costs = accounted(tmp_path)
    assert (costs.wall_s, costs.productive_s, costs.downtime_s) == pytest.approx((80.0, 19.0, 25.0))
    assert len(costs.faults) == 2 and len(costs.launch_ends) == 1 and len(costs.outages) == 1
    assert costs.redone_steps == 0 and costs.outages[0].process is None


def test_the_most_telling_record_names_the_step_and_a_clock_of_an_earlier_version_still_reads(tmp_path: Path) -> None:
    """A victim's record (order 5) written first does not name the fault's step; the culprit's does. A clock
    written before the first step's time and the launch were kept (with the `fault_at` it had then) is read, and
    its step 1 counted as start-up at the process's mean step time."""
    victim = asdict(record(10.0, "j", 0, "phase1 step 7", None, order=5, rank=0))
    culprit = asdict(record(10.5, "j", 0, "phase1 step 9", None, order=3))
    (fault,) = faults_of([victim, culprit, {"job": "j"}, "not a record"])
    assert (fault.time, fault.step, fault.steps_past_checkpoint) == (10.0, "phase1 step 9", 8)
    old = {"started_at": 0.0, "ranks": 2, "seconds": 10.0, "first_step": 1, "last_step": 4, "steps": 4,
           "step_seconds": 8.0, "restart": 0, "fault_at": None, "startup": {}}
    (tmp_path / CLOCK_FILE).write_text(json.dumps({"format": 1, "processes": [old], "targets": {}}))
    assert accounted(tmp_path).goodput == pytest.approx(3 * 2.0 / 10.0)


def test_the_runs_own_figure_is_the_reports(tmp_path: Path) -> None:
    """The live `time/goodput` of a restarted process, written by the real clock, equals what the module reads back
    from the files at the same moment: one definition, not two."""
    now = time.time()
    earlier = ProcessSpan(started_at=now - 300.0, ranks=2, seconds=100.0, first_step=1, last_step=40, steps=40,
                          step_seconds=20.0 + 39.0, first_step_s=20.0, job="bert-a", startup={"first_step": 50.0})
    write_clock(tmp_path, [earlier])
    FaultHistory(faults_dir(tmp_path)).add(record(now - 190.0, "bert-a", 0, "phase1 step 45", "phase1-step0000040"))
    started = time.monotonic() - 60.0  # this process started a minute ago
    quality = TimeToQuality(QualityPlan(tmp_path, 2, QualitySection([])), RunClock(tmp_path, 2, started=started))
    quality.clock.launched("bert-a", 1)
    quality.begin(41)
    quality.clock.mark("first_step", now=started + 30.0)
    figures = [quality.observe(41 + k, {"perf/step_s": 15.0 if k == 0 else 1.0}, None, now=started + 30.0 + k)
               [GOODPUT_TAG] for k in range(20)]
    quality.clock.save(now=started + 49.0)
    costs = accounted(tmp_path)
    assert figures[-1] == pytest.approx(costs.goodput, rel=1e-9)
    assert costs.productive_s == pytest.approx(39.0 + 19.0) and len(costs.faults) == 1
    assert costs.downtime_s == pytest.approx(190.0 - 60.0 + 30.0, abs=1.0)  # the clock reads time.time() itself
    assert costs.redone_steps == 4


def test_the_clock_is_written_with_every_checkpoint_and_keeps_step_1_apart(tmp_path: Path) -> None:
    """The metrics writer writes the clock with a checkpoint's row (checkpoint/save_s), not only once a minute: a
    process killed right after a checkpoint leaves every step the checkpoint kept on the clock."""
    writer = MetricsWriter(tmp_path / "tensorboard", True, QualityPlan(tmp_path, 1, QualitySection([])))
    writer.launched("bert-a", 2)
    for step, seconds in ((1, 5.0), (2, 1.0), (3, 1.0)):
        writer.scalars(step, {"perf/step_s": seconds, "loss/mlm": 1.0})
    written = json.loads((tmp_path / CLOCK_FILE).read_text())["processes"][0]
    assert (written["last_step"], written["steps"]) == (1, 1), "written at step 1, then not before a minute"
    writer.scalars(3, {"checkpoint/save_s": 0.2})
    written = json.loads((tmp_path / CLOCK_FILE).read_text())["processes"][0]
    assert (written["last_step"], written["steps"], written["step_seconds"]) == (3, 3, 7.0)
    assert (written["first_step_s"], written["job"], written["restart"]) == (5.0, "bert-a", 2)
    writer.close()
