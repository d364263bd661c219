"""The run's clock across stops and resumes: wall-clock and device-hours since its first start.

A run is often several processes: a SLURM job preempted and requeued, a Ctrl-C and a rerun, a resume on
another number of GPUs. "When did this run reach accuracy X, and what did it cost" needs the time of all
of them, so rank 0 keeps one small file in the run folder, `run_clock.json`, rewritten atomically:

    {"format": 1,
     "processes": [{"started_at": 1718000000.0, "ranks": 8, "seconds": 3600.0, "first_step": 0, "last_step": 500},
                   ...],
     "targets": {"0.72": {"step": 7000, "samples": ..., "wall_s": ..., "device_hours": ..., "val/mlm_acc": ...}}}

One entry per process that logged: when it started (Unix time), how many ranks it ran (the job's devices),
how many seconds it ran (from the process's own start, interpreter and imports included, read from
/proc on Linux), and the first and last global step it logged. The run's wall-clock is the sum of every
process's seconds: the time the run held its devices, without the queue waits between jobs. Its
device-hours are the sum of ranks x seconds / 3600. Work a stopped process did after its last checkpoint
is repeated by the next one and counted twice, as the devices really spent it.

What can be lost: the seconds since the file's last write when a process dies without running its
`finally` (kill -9, a node failure). The file is written at every validation, at the end of the process,
and at least once a minute while steps are logged (`SAVE_EVERY_S`), so at most about a minute.

The quality targets reached (pretrain/metrics/quality.py) are kept here too, so each is logged once over
the run. A resumed process starts logging at the step after its checkpoint, S: what the earlier process
logged from S on is dropped from metrics.jsonl and TensorBoard (pretrain/metrics/writer.py), and so are the
targets it reached from S on (`begin`), which the resumed run then reaches again.

Standard library only: the report (pretrain/report/write.py) reads the file without torch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pretrain.run_folder import CLOCK_FILE, faults_dir

CLOCK_FORMAT = 1
SAVE_EVERY_S = 60.0  # the most wall-clock a killed process can lose
# What a process's start-up is spent on, in order (seconds from the process's start to each, in its span):
# imports + joining the job + the plan and resume checks, the first engine built, the checkpoint loaded (a
# resume), the first optimizer step done.
STARTUP_MARKS = ("planned", "engine_built", "checkpoint_loaded", "first_step")


def process_age_seconds() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time vs /proc/uptime), else 0.

    The clock then counts the interpreter's start and the imports (torch alone takes seconds), which a
    user's job also pays for."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22 (starttime), after "(comm)"
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class ProcessSpan:
    """One process of the run, as the file keeps it."""

    started_at: float  # Unix time of the process's start
    ranks: int  # devices the process's job ran on
    seconds: float = 0.0  # how long it ran (until its last write)
    first_step: int | None = None  # the first global step it logged (None: it logged none)
    last_step: int | None = None
    steps: int = 0  # optimizer steps it logged
    step_seconds: float = 0.0  # their time (perf/step_s: validation included, checkpoint writes not)
    restart: int = 0  # which restart of the elastic agent started it (0: a launch)
    fault_at: float | None = None  # Unix time of the fault that ended the process before it (None: no fault)
    startup: dict[str, float] = field(default_factory=dict)  # seconds from its start to each mark (STARTUP_MARKS)

    @property
    def ended_at(self) -> float:
        return self.started_at + self.seconds

    @property
    def mean_step_seconds(self) -> float:
        return self.step_seconds / self.steps if self.steps else 0.0


class ClockFileError(ValueError):
    """run_clock.json is not what this module writes; the message names the file."""


def redone_steps(span: ProcessSpan, later: list[ProcessSpan]) -> int:
    """Steps `span` logged that a later process logged again (it resumed from an earlier checkpoint)."""
    if span.last_step is None:
        return 0
    restarts = [other.first_step for other in later if other.first_step is not None]
    return min(span.steps, max(0, span.last_step - min(restarts) + 1)) if restarts else 0


def downtime(before: ProcessSpan, span: ProcessSpan) -> float:
    """Seconds between `before`'s end and `span`'s start when a fault restarted it (the agent stopping the
    ranks, the rendezvous, the new processes' launch); 0 after a stop the user asked for."""
    return max(0.0, span.started_at - before.ended_at) if span.fault_at is not None else 0.0


def run_goodput(spans: list[ProcessSpan]) -> float:
    """Productive step time over wall time, for the run so far.

    Productive: every process's logged steps, less those a later process redid (counted at that process's mean
    step time). Wall: every process's seconds, plus the gaps between processes that a fault caused (a stop the
    user asked for, or a SLURM queue wait before a requeue, is not the run's doing and is not counted)."""
    wall = sum(span.seconds for span in spans) + sum(downtime(a, b) for a, b in zip(spans, spans[1:], strict=False))
    return productive_seconds(spans) / wall if wall > 0 else 0.0


def productive_seconds(spans: list[ProcessSpan]) -> float:
    """The time of the steps the run kept: every process's logged steps but those a later process redid."""
    return sum((span.steps - redone_steps(span, spans[i + 1:])) * span.mean_step_seconds for i, span in enumerate(spans))


def read_clock_file(path: Path) -> dict[str, Any]:
    """The file's content ({"processes": [], "targets": {}} when it does not exist yet)."""
    if not path.is_file():
        return {"format": CLOCK_FORMAT, "processes": [], "targets": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        processes = [ProcessSpan(**span) for span in data["processes"]]
        targets = dict(data.get("targets", {}))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ClockFileError(f"{path}: not a run clock file ({err})") from err
    return {"format": CLOCK_FORMAT, "processes": processes, "targets": targets}


def read_or_set_aside(path: Path) -> dict[str, Any]:
    """The driver's read: a damaged file is renamed to *.damaged with a warning and the clock starts afresh.

    Only rank 0 reads it, so raising would stop rank 0 alone and leave the others waiting in a collective;
    the run matters more than its clock."""
    try:
        return read_clock_file(path)
    except ClockFileError as err:
        os.replace(path, path.with_name(path.name + ".damaged"))
        print(f"warning: {err}; set aside as {path.name}.damaged, the run's clock starts afresh", flush=True)
        return read_clock_file(path)


# When the last clock of this process was closed (time.monotonic()): a second run in the same process (a
# notebook, a test calling pretrain.train.train twice) counts from there, not from the interpreter's start.
_closed_in_this_process: list[float] = []


def process_started() -> float:
    """time.monotonic() at this process's start, or at the close of its previous clock."""
    started = time.monotonic() - process_age_seconds()
    return max([started, *_closed_in_this_process])


class RunClock:
    """This process's share of the run's clock, added to what the file says earlier processes ran.

    Only rank 0 makes one (the other ranks' processes run as long). `now` arguments are
    `time.monotonic()` values; tests pass them to simulate time."""

    def __init__(self, run_dir: Path, ranks: int, started: float | None = None) -> None:
        self.path = Path(run_dir) / CLOCK_FILE
        earlier = read_or_set_aside(self.path)
        self.earlier: list[ProcessSpan] = earlier["processes"]
        self.targets: dict[str, dict[str, Any]] = earlier["targets"]
        self.started = process_started() if started is None else started
        age = time.monotonic() - self.started
        self.span = ProcessSpan(started_at=time.time() - age, ranks=ranks)
        self._saved_at: float | None = None

    def elapsed(self, now: float | None = None) -> float:
        """Seconds this process has run."""
        return max(0.0, (time.monotonic() if now is None else now) - self.started)

    def wall_seconds(self, now: float | None = None) -> float:
        """Seconds the run has run, over all its processes (this one until `now`)."""
        return sum(span.seconds for span in self.earlier) + self.elapsed(now)

    def device_hours(self, now: float | None = None) -> float:
        """Ranks x hours, summed over the run's processes."""
        earlier = sum(span.ranks * span.seconds for span in self.earlier)
        return (earlier + self.span.ranks * self.elapsed(now)) / 3600.0

    def begin(self, step: int) -> None:
        """This process logs from global step `step` on: targets an earlier process reached from there on
        belong to steps the resume repeats (and whose rows metrics.jsonl drops), so they are forgotten."""
        if self.span.first_step is None:
            self.span.first_step = step
            self.targets = {key: mark for key, mark in self.targets.items() if mark["step"] < step}

    def mark(self, name: str, now: float | None = None) -> None:
        """This process reached start-up mark `name` (STARTUP_MARKS); the first time counts."""
        self.span.startup.setdefault(name, round(self.elapsed(now), 3))

    def after_fault(self, restart: int, fault_at: float | None) -> None:
        """This process is the elastic agent's restart `restart`, after a fault at Unix time `fault_at`."""
        self.span.restart, self.span.fault_at = restart, fault_at

    def goodput(self, now: float | None = None) -> float:
        """The run's productive step time over its wall time so far (run_goodput)."""
        self.span.seconds = self.elapsed(now)
        return run_goodput([*self.earlier, self.span])

    def logged(self, step: int, now: float | None = None, step_seconds: float | None = None) -> None:
        """A row of `step` was logged (a training step's, with its `step_seconds`): remember it, and write the
        file when the last write is a minute old."""
        self.span.last_step = step
        if step_seconds is not None:
            self.span.steps += 1
            self.span.step_seconds += step_seconds
        now = time.monotonic() if now is None else now
        if self._saved_at is None or now - self._saved_at >= SAVE_EVERY_S:
            self.save(now)

    def save(self, now: float | None = None) -> None:
        """Write the file atomically: the earlier processes, this one until `now`, the targets reached."""
        now = time.monotonic() if now is None else now
        self.span.seconds = self.elapsed(now)
        data = {"format": CLOCK_FORMAT, "processes": [asdict(span) for span in [*self.earlier, self.span]],
                "targets": self.targets}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(partial, self.path)
        self._saved_at = now

    def close(self, now: float | None = None) -> None:
        """The process's last write; a later clock in this process starts counting here."""
        now = time.monotonic() if now is None else now
        self.save(now)
        _closed_in_this_process[:] = [now]


def last_fault_time(run_dir: Path) -> float | None:
    """When the agents judged the last fault (its record's "time", seconds since the epoch), the one this process
    restarts after; None without a record. Read as plain JSON: the launcher that writes the records sits above us."""
    times = []
    for path in faults_dir(run_dir).glob("*.json"):
        try:
            times.append(float(json.loads(path.read_text(encoding="utf-8"))["time"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a record being replaced, or not ours
    return max(times, default=None)
