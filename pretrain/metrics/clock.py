"""The run's clock across stops and resumes: wall-clock and device-hours since its first start.

A run is often several processes: a SLURM job preempted and requeued, a Ctrl-C and a rerun, a resume on
another number of GPUs. "When did this run reach accuracy X, and what did it cost" needs the time of all
of them, so rank 0 keeps one small file in the run folder, `run_clock.json`, rewritten atomically:

    {"format": 1,
     "processes": [{"started_at": 1718000000.0, "ranks": 8, "seconds": 3600.0, "first_step": 1, "last_step": 500,
                    "steps": 500, "step_seconds": 3400.0, "first_step_s": 150.0, "restart": 0,
                    "job": "bert-0123456789ab", "startup": {"planned": 40.0, ..., "first_step": 260.0}},
                   ...],
     "targets": {"0.72": {"step": 7000, "samples": ..., "wall_s": ..., "device_hours": ..., "val/mlm_acc": ...}}}

One entry per process that logged: when it started (Unix time), how many ranks it ran (the job's devices),
how many seconds it ran (from the process's own start, interpreter and imports included, read from
/proc on Linux), the first and last global step it logged, its optimizer steps and their time (the first
step's apart: it is start-up), its start-up marks, and which launch of the elastic agent and which restart
of it started it. The run's wall-clock (time/wall_s) is the sum of every process's seconds: the time the
run held its devices, without the queue waits between jobs. Its device-hours are the sum of ranks x
seconds / 3600. Work a stopped process did after its last checkpoint
is repeated by the next one and counted twice, as the devices really spent it.

What can be lost: the seconds since the file's last write when a process dies without running its
`finally` (kill -9, a node failure, the agent's stop after a fault). The file is written at every committed
checkpoint (`RunClock.save`, called by the metrics writer), at every validation, at the end of the process, and
at least once a minute while steps are logged (`SAVE_EVERY_S`), so at most about a minute, and never a step a
checkpoint kept. What the run's time went to (goodput, start-up, downtime, steps redone) is read from this file
and the fault records by pretrain/metrics/goodput.py, the one definition.

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

from pretrain.run_folder import CLOCK_FILE

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
    steps: int = 0  # optimizer steps it logged, its first included
    step_seconds: float = 0.0  # their time (perf/step_s: validation included, checkpoint writes not)
    first_step_s: float | None = None  # its first step's time (compilation, warm-up): start-up, not productive
    restart: int = 0  # which restart of the elastic agent's launch started it (0: the launch's first start)
    job: str | None = None  # that launch's id (the agent's run id, as its fault records name it; None: no agent)
    startup: dict[str, float] = field(default_factory=dict)  # seconds from its start to each mark (STARTUP_MARKS)


KNOWN_FIELDS = frozenset(ProcessSpan.__dataclass_fields__)


class ClockFileError(ValueError):
    """run_clock.json is not what this module writes; the message names the file."""


def read_clock_file(path: Path) -> dict[str, Any]:
    """The file's content ({"processes": [], "targets": {}} when it does not exist yet)."""
    if not path.is_file():
        return {"format": CLOCK_FORMAT, "processes": [], "targets": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        processes = [span_of(span) for span in data["processes"]]
        targets = dict(data.get("targets", {}))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ClockFileError(f"{path}: not a run clock file ({err})") from err
    return {"format": CLOCK_FORMAT, "processes": processes, "targets": targets}


def span_of(entry: dict[str, Any]) -> ProcessSpan:
    """A process of the file, its keys that this version does not know left out (an older file's `fault_at`)."""
    return ProcessSpan(**{key: value for key, value in entry.items() if key in KNOWN_FIELDS})


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

    def launched(self, job: str | None, restart: int) -> None:
        """This process was started by launch `job` of the elastic agent (its run id), at its restart `restart`: how
        the fault records of that launch are matched to it (pretrain/metrics/goodput.py)."""
        self.span.job, self.span.restart = job, restart

    def spans(self, now: float | None = None) -> list[ProcessSpan]:
        """The run's processes so far: the earlier ones, and this one until `now`."""
        self.span.seconds = self.elapsed(now)
        return [*self.earlier, self.span]

    def logged(self, step: int, now: float | None = None, step_seconds: float | None = None) -> None:
        """A row of `step` was logged (a training step's, with its `step_seconds`): remember it, and write the
        file when the last write is a minute old."""
        self.span.last_step = step
        if step_seconds is not None:
            if not self.span.steps:  # this process's step 1: start-up (pretrain/metrics/goodput.py)
                self.span.first_step_s = step_seconds
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
