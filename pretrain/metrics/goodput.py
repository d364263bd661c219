"""What a run's time went to, in one definition: goodput, start-up, downtime, steps redone.

The run's own figure (`time/goodput` on every training row, pretrain/metrics/quality.py), `./launch.sh report`
(pretrain/report/write.py), the demo's summary and bench/fault_cost.py all call `account`, so each says the same
of the same run. It reads what the run leaves in its folder:

- run_clock.json (pretrain/metrics/clock.py): each process's start, its time up to its last write of the file,
  the steps it logged and their time, its first step's time, its start-up marks, which launch (the agent's job
  id) and which restart of it started it. Rank 0 writes it at every committed checkpoint, at every validation,
  at least once a minute while steps are logged, and at its end;
- the fault records in RUN/logs/faults/, one JSON file per node that judged a fault (written by the elastic
  agents, pretrain/launch/faults.py; read here as plain JSON: the launcher sits above this floor).

The definitions (tests/metrics/test_goodput.py works them through by hand):

    wall          the time the run's launches held their devices: each process from its start to its last
                  write of the clock, or to the fault that ended it when that is later; and between two
                  processes of one launch (the agent stopping the old ranks, the rendezvous, the new ranks'
                  spawn). Not counted: the time between launches (a queue wait, a requeue, a person's rerun)
                  and launch.sh's checks before a launch's first process.
    start-up      each process's time from its start to the end of its first optimizer step: imports, joining
                  the job, the checks, the engine, the checkpoint load, and step 1 itself (compilation, first
                  allocations, the data stream's first read).
    productive    the steps the run kept: each process's logged steps but its first one and those a later
                  process did again, at that process's mean time per step over its steps after the first
                  (validation included, checkpoint writes not).
    goodput       productive / wall.
    fault         the records of one launch and restart: one fault however many nodes wrote a record of it.
    downtime      from a fault to the end of the first step of the process that recovered from it, as a
                  stopwatch sees it: from the failed process's last progress, its record's time less the time
                  the failure went unseen (detection: for a hang, the limit that ran out), so a hang's outage
                  holds run.hang_timeout_minutes. Faults before that step (a restart that died starting) make
                  one outage.
    detection     the part of the downtime before the agents acted: the hang limits that ran out.
    steps redone  the steps a process had done past the checkpoint that a later process resumed from: told by
                  the step the failed rank held (its record), else by what the clock logged past it.

The clock is written at every committed checkpoint, so every step a checkpoint kept is on it even when the
process is killed with SIGKILL; steps after the last write are in the wall time (up to the fault) and not in
the productive time: a restart does them again. A process killed before its first write (during its start-up)
leaves no entry; its launch's fault records still count, and its outage runs from its fault. A fault that
ended a launch (no restart left) is counted, and the time until the run was launched again is not.

Standard library only (and ground-floor names): the report reads this without torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from pretrain.checkpointing.layout import tag_order
from pretrain.distributed.step_watch import parse_step
from pretrain.run_folder import faults_dir

FIRST_STEP_MARK = "first_step"  # the start-up mark at the end of a process's first step (clock.STARTUP_MARKS)


class Span(Protocol):
    """What the definition reads of one process: pretrain/metrics/clock.py's ProcessSpan."""

    started_at: float
    seconds: float
    first_step: int | None
    last_step: int | None
    steps: int
    step_seconds: float
    first_step_s: float | None
    restart: int
    job: str | None
    startup: dict[str, float]


@dataclass(frozen=True)
class Fault:
    """One fault: the records of one launch (`job`) and restart, every node's, taken together."""

    job: str
    restart: int  # the launch's restarts before the attempt that failed
    time: float  # the earliest record's: when the first agent judged it (within its 0.2 s poll of the death)
    restarted: bool  # every record's verdict was a restart (else the launch ended here)
    step: str | None  # what the failed rank was doing, from the most telling record ("phase1 step 12")
    checkpoint: str | None  # the checkpoint the restart resumes from (None: the start)
    kind: str
    line: str
    detection_s: float = 0.0  # how long it went unseen before that (a hang: its limit; FaultRecord.detection_s)

    @property
    def began(self) -> float:
        """The failed process's last progress: where a stopwatch starts the outage."""
        return self.time - self.detection_s

    @property
    def steps_past_checkpoint(self) -> int:
        """Steps done past the checkpoint a restart resumes from: the step the failed rank held, which it had not
        finished, less one, less the checkpoint's step in the same phase. 0 for a rank that died starting."""
        held = parse_step(self.step)
        if held is None:
            return 0
        phase, step = held
        saved_phase, saved_step = tag_order(PurePosixPath(self.checkpoint).name) if self.checkpoint else ("", -1)
        return max(0, step - 1 - (saved_step if saved_phase == phase else 0))


@dataclass(frozen=True)
class Outage:
    """Faults in a row, from the first one to the end of the first step of the process that recovered."""

    faults: tuple[Fault, ...]
    start: float
    end: float | None  # None: nothing recovered (the launch ended, or the restart has not stepped yet)
    process: int | None  # the recovering process's place among the clock's processes

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start) if self.end is not None else 0.0

    @property
    def detection_s(self) -> float:
        """Its part before the agents acted (the first fault's; a later one's lies inside the outage already)."""
        return min(self.faults[0].detection_s, self.seconds) if self.end is not None else 0.0


@dataclass(frozen=True)
class ProcessCost:
    """One process of the clock, accounted."""

    end: float  # its last write of the clock, or the fault that ended it when later
    startup_s: float  # its start to the end of its first step (all of its time when it made none)
    productive_s: float
    redone_steps: int  # its steps that a later process did again
    ended_by: Fault | None  # the fault of its own attempt
    after: Fault | None  # the fault of its launch's attempt before it (None: a launch's start, or a node joined)


@dataclass(frozen=True)
class Accounting:
    """The run's time, by the module's definitions."""

    wall_s: float
    processes: tuple[ProcessCost, ...]
    faults: tuple[Fault, ...]
    outages: tuple[Outage, ...]

    @property
    def productive_s(self) -> float:
        return sum(cost.productive_s for cost in self.processes)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def startup_s(self) -> float:
        return sum(cost.startup_s for cost in self.processes)

    @property
    def downtime_s(self) -> float:
        return sum(outage.seconds for outage in self.outages)

    @property
    def detection_s(self) -> float:
        return sum(outage.detection_s for outage in self.outages)

    @property
    def recovery_s(self) -> float | None:
        """R, the mean outage of the faults the run recovered from (detection included); None: none recovered."""
        recovered = [outage.seconds for outage in self.outages if outage.end is not None]
        return sum(recovered) / len(recovered) if recovered else None

    @property
    def redone_steps(self) -> int:
        return sum(cost.redone_steps for cost in self.processes)

    @property
    def launch_ends(self) -> tuple[Fault, ...]:
        """Faults that ended their launch (no restart): the time until a rerun is not in the wall time."""
        return tuple(fault for fault in self.faults if not fault.restarted)

    def outage_before(self, process: int) -> Outage | None:
        """The outage that the first step of process `process` ended (None: it started after no fault)."""
        return next((outage for outage in self.outages if outage.process == process), None)


def read_faults(run_dir: Path) -> list[Fault]:
    """The run's faults from its records, oldest first (a record being written or not ours is skipped)."""
    records = []
    for path in sorted(faults_dir(run_dir).glob("*.json")):
        try:
            records.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return faults_of(records)


def faults_of(records: Iterable[Any]) -> list[Fault]:
    """One Fault per launch and restart among `records` (fault records as JSON objects), oldest first. Its step,
    checkpoint and line are the most telling record's (lowest order: a culprit before a victim, then the earliest)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in records:
        try:
            key = (str(record["job"]), int(record["restart"]))
            float(record["time"])
        except (KeyError, TypeError, ValueError):
            continue
        groups.setdefault(key, []).append(record)
    faults = []
    for (job, restart), group in groups.items():
        telling = min(group, key=lambda r: (r.get("order", math.inf), r.get("failed_at") or float(r["time"])))
        faults.append(Fault(job, restart, min(float(r["time"]) for r in group),
                            all(bool(r.get("restarts")) for r in group), telling.get("step"),
                            telling.get("checkpoint"), str(telling.get("kind", "")), str(telling.get("line", "")),
                            max(_seconds(r.get("detection_s")) for r in group)))
    return sorted(faults, key=lambda fault: fault.time)


def _seconds(value: Any) -> float:
    """A record's non-negative seconds; 0 for a record from before the field, or a value that is none."""
    return float(value) if isinstance(value, int | float) and math.isfinite(value) and value > 0 else 0.0


def steady_step_seconds(span: Span) -> float:
    """The process's mean time per step over its steps after the first (the first is start-up). A clock from
    before the first step's time was kept: its mean over all steps."""
    if span.steps <= 1:
        return 0.0
    if span.first_step_s is None:
        return span.step_seconds / span.steps
    return max(0.0, span.step_seconds - span.first_step_s) / (span.steps - 1)


def logged_redone(span: Span, later: Sequence[Span]) -> int:
    """Steps `span` logged that a later process logged again (it resumed from an earlier checkpoint)."""
    restarts = [other.first_step for other in later if other.first_step is not None]
    if span.last_step is None or not restarts:
        return 0
    return min(span.steps, max(0, span.last_step - min(restarts) + 1))


def first_step_at(span: Span) -> float | None:
    """When the process's first step ended (Unix time), from its start-up mark; None before it."""
    mark = span.startup.get(FIRST_STEP_MARK)
    return span.started_at + mark if mark is not None else None


def _same_job(span: Span, fault: Fault) -> bool:
    return span.job is None or span.job == fault.job  # a clock from before the job was kept: by time alone


def _restart_of(before: Span, span: Span) -> bool:
    """Whether `span` is the agent's restart of `before`'s launch (the time between them is the launch's)."""
    return span.restart > before.restart and (span.job is None or before.job is None or span.job == before.job)


def account(spans: Sequence[Span], faults: Sequence[Fault]) -> Accounting:
    """The run's time by the module's definitions, from its clock's processes (in order) and its faults."""
    faults = sorted(faults, key=lambda fault: fault.time)
    intervals: list[tuple[float, float]] = []
    costs: list[ProcessCost] = []
    for index, span in enumerate(spans):
        following = spans[index + 1].started_at if index + 1 < len(spans) else math.inf
        ended_by = next((f for f in faults if _same_job(span, f) and f.restart == span.restart
                         and span.started_at <= f.time < following), None)
        end = span.started_at + span.seconds
        end = max(end, ended_by.time) if ended_by is not None else end
        intervals.append((span.started_at, end))
        if index and _restart_of(spans[index - 1], span):
            intervals.append((costs[-1].end, span.started_at))
        logged = logged_redone(span, spans[index + 1:])
        # the steps past its last write are on no clock: the failed rank's record tells them, once a process resumed
        redone = max(logged, ended_by.steps_past_checkpoint) if ended_by and index + 1 < len(spans) else logged
        kept = span.steps - logged
        mark = span.startup.get(FIRST_STEP_MARK)
        startup = mark if mark is not None else (end - span.started_at if span.steps == 0 else 0.0)
        after = next((f for f in faults if _same_job(span, f) and f.restart == span.restart - 1
                      and f.time <= span.started_at), None) if span.restart else None
        costs.append(ProcessCost(end, startup, max(0, kept - 1) * steady_step_seconds(span), redone, ended_by, after))
    outages = _outages(spans, faults, costs)
    intervals += [(outage.start, outage.end) for outage in outages if outage.end is not None]
    return Accounting(_union_length(intervals), tuple(costs), tuple(faults), tuple(outages))


def _recovery(fault: Fault, spans: Sequence[Span], faults: Sequence[Fault],
              costs: Sequence[ProcessCost]) -> tuple[float | None, int | None]:
    """When the launch was back after `fault`: the end of the first step of its first later process that made one,
    and that process. Without one (the launch ended there, or its restart has made no step yet), the launch's last
    sign of life after the fault (a later fault's record, a later process's last write), else None."""
    later = [index for index, span in enumerate(spans)
             if span.started_at > fault.time and _same_job(span, fault) and span.restart > fault.restart]
    for index in later:
        stepped = first_step_at(spans[index])
        if stepped is not None:
            return stepped, index
    signs = [costs[index].end for index in later] + [f.time for f in faults
                                                      if f.job == fault.job and f.restart > fault.restart]
    return (max(signs), None) if signs else (None, None)


def _outages(spans: Sequence[Span], faults: Sequence[Fault], costs: Sequence[ProcessCost]) -> list[Outage]:
    """Each fault from its time to its recovery, those that overlap merged into one outage."""
    outages: list[Outage] = []
    for fault in faults:
        end, process = _recovery(fault, spans, faults, costs)
        last = outages[-1] if outages else None
        if last is not None and last.end is not None and fault.began <= last.end:
            later = end is not None and end > last.end
            outages[-1] = Outage((*last.faults, fault), last.start, end if later else last.end,
                                 process if later else last.process)
        else:
            outages.append(Outage((fault,), fault.began, end, process))
    return outages


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """The time covered by `intervals`, overlaps counted once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > max(start, reach):
            total += end - max(start, reach)
            reach = end
    return total
