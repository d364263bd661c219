"""A failed rank, judged once and told in one line: who, how it died, where, and what happens next; and the fault
record, the one form in which a fault is kept and handed on.

The elastic agent (pretrain/launch/agent.py) hands each failure of its worker group here. This module decides
nothing about processes; it reads the run folder (the newest checkpoint, the fault records, a rank's log) and
words the lines the terminal shows:

    launch.sh: fault: rank 1 (host n1) died of SIGKILL at phase1 step 12; restarting from checkpoint
        phase1-step10 (restart 1 of 3); log: RUN/logs/20260102-010203/attempt-0/rank-1.log
    launch.sh: error: rank 1 (host n1) died of SIGKILL at phase1 step 12; no restart left
        (run.max_restarts=0); last checkpoint phase1-step10; log: ...; resume with: ./launch.sh pretrain ...

Which rank is named (`failure_order`): a frozen rank, then one whose timer ran out, then one killed by a signal
other than SIGTERM (the agent's own stop) and SIGABRT (a peer that NCCL's watchdog aborted because of another),
then a rank's own error (exit 2-4), then an exception of its own (exit 1 with any exception but a victim's) or
another non-zero exit, then the victims: exit 1 on a lost peer, and SIGABRT; then a rank its agent stopped because
a node was lost or because another rank had failed (BY_AGENT). A victim is told from its log's whole last
traceback, as torch writes it over several lines (pretrain/launch/fault_texts.py: a closed or reset connection, the
ranks' store gone or waiting for a rank, NCCL's "remote process exited", a watchdog timeout); a SIGABRT whose last
words are its own CUDA error (NCCL's watchdog aborting it for its own GPU) is a culprit's signal.
Among equals the one that failed first (RankFailure.failed_at), never the lower rank. The others died of its death,
as their logs say.

Kinds of failure that are no fault, and are never restarted: a rank that had said its run ended (RUN_ENDED_PREFIX:
"complete" or the stop it was asked for) and then hung or crashed on its way out (one warning line, status 0, no
record kept); exit status 2 (a config, data or resume error the ranks found: its line is shown once, and the job
exits 2), 3 (NaN/inf losses, after a checkpoint) and 4 (a checkpoint or export that could not be written: the
rank's own line says why). The same failure again (the same
kind, cause, step and error line as the culprit of the attempt before, with no newer checkpoint since) is a bug
rather than a fault: restarting would fail there again, so restarts stop. The attempt before is decided by its
culprit, the most telling of every node's records of it (fault_records.attempt_culprit), never by this node's own
record: a node whose rank only lost its peer, even with a text no list knows, is never "the same failure" unless
it was that culprit. A victim's record (a rank that died of another's failure) is never the same failure again:
its line is the same whatever killed its peer. The restart budget, run.max_restarts, counts the faults since the
checkpoint the job restarts from (FaultHistory.spent_since): a newer checkpoint is progress and starts it again, so
a long job that commits checkpoints between faults outlives any number of them, and a job that fails again and
again without progress stops after run.max_restarts.

`FaultRecord` (pretrain/launch/fault_records.py) is the one definition of a judged fault. Each agent writes one per
failure into RUN/logs/faults/ (FaultHistory), so every node judges "the same failure again" and the budget against
the same history, and what the faults cost can be read back (time, kind, restart, the checkpoint restarted from).
An agent under pretrain/launch/nodes.py also prints it as one JSON line (RECORD_PREFIX); nodes.py reads it back
with `FaultRecord.from_line` and shows the most telling node's line.

Standard library only (and pretrain/errors.py, the driver's exit statuses and error prefixes; pretrain/run_folder.py;
the rank's last word, RUN_ENDED_PREFIX, from pretrain/distributed/step_watch.py).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from pretrain.distributed.step_watch import RUN_ENDED_PREFIX
from pretrain.errors import (
    ERROR_PREFIXES,
    EVICT_PREFIX,
    NONFINITE_EXIT,
    SAVE_FAILED_EXIT,
    SLOW_EVICT_EXIT,
    USER_ERROR_EXIT,
)
from pretrain.launch.bad_nodes import HostFaults, Room, drop_reason, evicted_host
from pretrain.launch.fault_history import FaultHistory
from pretrain.launch.fault_records import (  # noqa: F401 - AgentEnd, RECORD_PREFIX: importers read them here too
    RECORD_PREFIX,
    VICTIM_ORDER,
    AgentEnd,
    FaultRecord,
    attempt_culprit,
)
from pretrain.launch.fault_texts import (
    exception_line,
    log_lines,
    out_of_space,
    own_device_error,
    victim_log,
)
from pretrain.run_folder import CHECKPOINTS

NOT_RESTARTED = {USER_ERROR_EXIT: "a config, data or resume error", NONFINITE_EXIT: "NaN/inf losses",
                 SAVE_FAILED_EXIT: "a checkpoint or export that could not be written"}
KINDS = {USER_ERROR_EXIT: "config", NONFINITE_EXIT: "nonfinite", SAVE_FAILED_EXIT: "save", SLOW_EVICT_EXIT: "slow"}
NODE_LOST = "stopped by its agent: a node of the job was lost"
BY_AGENT = "killed by its agent: another rank of the job had failed"


@dataclass(frozen=True)
class RankFailure:
    """One rank's end, as the agent saw it. `exitcode` < 0: killed by signal -exitcode."""

    rank: int
    host: str
    exitcode: int
    step: str | None  # the timer it held last ("phase1 step 12", "start-up", "phase1 set-up"); None: none yet
    log: Path
    hang: str | None = None  # "made no progress in 10 min (...)": its timer ran out
    node_lost: bool = False  # its agent killed it: a node of the job was lost
    trace: Path | None = None  # where NCCL's flight recorder dumps this rank's collectives (when it does)
    stacks: bool = False  # asked for its stacks (they are in its log) before it was killed
    noticed: float | None = None  # when torch saw it end (ProcessFailure.timestamp: whole seconds)
    by_agent: bool = False  # its agent killed it: another rank of its group had failed (a victim)
    hang_s: float | None = None  # with `hang`: the limit that ran out (its last progress was that long before)

    @property
    def failed_at(self) -> float:
        """When it failed, as near as can be told: its log's last write (a rank's traceback is its last word, and a
        victim writes its own only after its peer is gone), no later than torch saw it end (whole seconds, so + 1).
        What breaks a tie between two equally telling failures; infinite when nothing tells."""
        try:
            written = self.log.stat().st_mtime
        except OSError:
            written = math.inf
        return min(written, self.noticed + 1) if self.noticed is not None else written

    @property
    def ended_run(self) -> str | None:
        """How its run ended, when the rank said so in its log before it failed (reported_end); None: it failed
        before its run ended, a fault."""
        return reported_end(self.log)

    @property
    def kind(self) -> str:
        if self.hang:
            return "hang"
        if self.node_lost:
            return "node"
        return KINDS.get(self.exitcode, "signal" if self.exitcode < 0 else "exit")

    @property
    def cause(self) -> str:
        if self.hang:
            return f"{self.hang}: killed"
        if self.node_lost:
            return NODE_LOST
        if self.by_agent:
            return BY_AGENT
        if self.exitcode < 0:
            try:
                return f"died of {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"died of signal {-self.exitcode}"
        return f"exited with status {self.exitcode}"

    @property
    def where(self) -> str:
        step = self.step or "start-up"
        return f"at {step}" if " step " in step else f"during {step}"

    @property
    def exit_status(self) -> int:
        """What the job exits with when this failure ends it: the shell's 128 + signal, or the exit code."""
        return 128 - self.exitcode if self.exitcode < 0 else self.exitcode

    def line(self) -> str:
        return f"rank {self.rank} (host {self.host}) {self.cause} {self.where}"

    def files(self) -> str:
        """Where the evidence is: the rank's log (with its stacks after a hang), NCCL's trace when it dumped one."""
        trace = f"; NCCL trace: {self.trace}" if self.trace is not None and self.trace.is_file() else ""
        return f"log{' (with its stacks)' if self.stacks else ''}: {self.log}{trace}"


def failure_order(failure: RankFailure) -> int:
    """How telling a failure is (lower: more), the module docstring's order; the same for the ranks of one node
    (primary_failure) and for the nodes of a job (pretrain/launch/nodes.py, through FaultRecord.order)."""
    victims = (signal.SIGTERM, signal.SIGABRT)
    if failure.hang:
        return 0 if "stopped by SIGSTOP" in failure.hang else 1
    if failure.node_lost or failure.by_agent:
        return VICTIM_ORDER + 1
    if failure.exitcode < 0:
        if -failure.exitcode == signal.SIGABRT and own_device_error(failure.log):
            return 2  # NCCL's watchdog aborted it for its own GPU's error: the culprit, as any other signal
        return 7 if -failure.exitcode == signal.SIGTERM else VICTIM_ORDER if -failure.exitcode in victims else 2
    if failure.exitcode in NOT_RESTARTED or (failure.exitcode == SLOW_EVICT_EXIT and evicted_host(failure.log)):
        return 3  # a rank's own verdict (for an eviction: the rank that named the slow host)
    if failure.exitcode == 1 and not error_line(failure.log):  # the driver's own error line: never a victim's
        return VICTIM_ORDER if victim_log(failure.log) else 4
    return 4


def primary_failure(failures: list[RankFailure]) -> RankFailure:
    """The failure that ended the group: the most telling (failure_order), then the one that failed first
    (RankFailure.failed_at); the rank number only when nothing tells the times apart."""
    return min(failures, key=lambda failure: (failure_order(failure), failure.failed_at, failure.rank))


def error_line(log: Path) -> str | None:
    """The last line of a rank's log that the driver prints for an error of its own ("config error: ...")."""
    return next((line.strip() for line in reversed(log_lines(log)) if line.startswith(ERROR_PREFIXES)), None)


def reported_end(log: Path) -> str | None:
    """How the rank's run ended, when it said so in its log before it failed (RUN_ENDED_PREFIX: "complete", or the
    stop it was asked for); None: it failed before its run ended."""
    return next((line[len(RUN_ENDED_PREFIX):].strip() for line in reversed(log_lines(log))
                 if line.startswith(RUN_ENDED_PREFIX)), None)


def latest_checkpoint(checkpoint_dir: Path) -> str | None:
    """The tag `latest` names (what a restart resumes from), or None before the first checkpoint."""
    try:
        return (checkpoint_dir / "latest").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class FaultContext:
    """What judging a failure needs besides the failure: the launch and attempt, the restart budget, where the
    failed rank's checkpoints are (and the run folder the line names them from), the command that resumes."""

    job: str
    max_restarts: int
    run_dir: Path
    checkpoint_dir: Path
    resume_command: str
    room: Room = Room()  # the failed world's nodes and --nodes MIN:MAX: whether a bad host may leave (bad_nodes.py)
    host_faults: HostFaults = HostFaults(limit=0)  # the per-host fault-rate guard (run.host_fault_limit, _hours)

    def checkpoint_name(self, tag: str) -> str:
        """A tag as the line names it: alone in the run's own checkpoint folder, else with its folder (a plug-in's
        group<g>/checkpoints, or checkpoint.dir elsewhere)."""
        if self.checkpoint_dir == self.run_dir / CHECKPOINTS:
            return tag
        try:
            return f"{self.checkpoint_dir.relative_to(self.run_dir)}/{tag}"
        except ValueError:
            return str(self.checkpoint_dir / tag)


def judge(failure: RankFailure, restarts_done: int, context: FaultContext, history: FaultHistory) -> FaultRecord:
    """Restart (with its one line) or stop (with the one error line and the status the job exits with); the record
    goes into `history` either way."""
    tag = latest_checkpoint(context.checkpoint_dir)
    checkpoint = context.checkpoint_name(tag) if tag else None
    found = error_line(failure.log)
    detail = found or exception_line(failure.log)
    failed_at = failure.failed_at
    fields = dict(job=context.job, host=failure.host, restart=restarts_done, kind=failure.kind, rank=failure.rank,
                 cause=failure.cause, step=failure.step, detail=detail, checkpoint=checkpoint,
                 order=failure_order(failure), failed_at=failed_at if math.isfinite(failed_at) else None,
                 detection_s=(failure.hang_s or 0.0) if failure.hang else 0.0)
    log = failure.files()
    ended = failure.ended_run
    if ended is not None:  # its run was over: a hang or a crash on its way out is no fault, and not kept as one
        line = (f"warning: {failure.line()} after its run ended ({ended}): not restarted, the run's end stands; "
                f"{log}")
        return FaultRecord(time.time(), **fields, restarts=False, exit_status=0, line=line)
    if failure.exitcode in NOT_RESTARTED and not (failure.hang or failure.node_lost):
        if found and failure.exitcode in (USER_ERROR_EXIT, SAVE_FAILED_EXIT):  # the rank's own words say it all
            line, status = found, failure.exitcode
        else:
            line = (f"error: {failure.line()}: {NOT_RESTARTED[failure.exitcode]}, not restarted"
                    f"{': ' + found if found else ''}; {log}")
            status = failure.exit_status
        return _keep(history, FaultRecord(time.time(), **fields, restarts=False, exit_status=status, line=line))
    if out_of_space(detail) and fields["order"] < VICTIM_ORDER:  # a restart meets the same full disk: no restart
        line = (f"error: {failure.line()}: its file system is full or its quota spent ({detail}); free space there, "
                f"then resume with: {context.resume_command}; {log}")
        return _keep(history, FaultRecord(time.time(), **fields, restarts=False, exit_status=1, line=line))
    culprit = attempt_culprit(history.previous_attempt(context.job, restarts_done))
    probe = FaultRecord(time.time(), **fields, restarts=True, exit_status=0, line="")
    start = f"checkpoint {checkpoint}" if checkpoint else "the start (no checkpoint yet)"
    if failure.exitcode == SLOW_EVICT_EXIT and not (failure.hang or failure.node_lost):
        return _keep(history, judge_eviction(failure, probe, context, start))
    why = drop_reason(probe, culprit, history.recent(context.job, failure.host), context.room, context.host_faults)
    if why is not None:  # a bad host leaves the job; the others restart without it (no restart spent)
        line = (f"fault: node {failure.host} dropped: {failure.line()}: {why}; {context.room.carrying_on()}, "
                f"from {start}; {log}")
        return _keep(history, dataclasses.replace(probe, drop=True, exit_status=1, line=line))
    spent = history.spent_since(context.job, checkpoint, restarts_done)
    # "the same failure again": the attempt before was decided by its culprit, the most telling record of every
    # node's (never this node's own record, which may be a victim's); a victim (a lost node, a peer gone, NCCL's
    # abort) is another's doing: never "the same failure", however often
    if (not probe.victim and culprit is not None and not culprit.victim and culprit.key == probe.key
            and culprit.checkpoint == checkpoint):
        why = (f"the same failure as the last one, at the same step with no newer checkpoint: a bug, not a fault, "
               f"so no restart; last checkpoint {checkpoint or 'none'}")
    elif spent >= context.max_restarts:
        spent_line = ", all spent since that checkpoint" if context.max_restarts else ""
        why = (f"no restart left (run.max_restarts={context.max_restarts}){spent_line}; last checkpoint "
               f"{checkpoint or 'none'}")
    else:
        budget = f"restart {spent + 1} of {context.max_restarts}"
        line = f"fault: {failure.line()}; restarting from {start} ({budget}); {log}"
        return _keep(history, dataclasses.replace(probe, line=line))
    # status 1, not the rank's: a status >= 128 from a node means the node was lost (pretrain/launch/nodes.py)
    line = f"error: {failure.line()}; {why}; {log}; resume with: {context.resume_command}"
    return _keep(history, dataclasses.replace(probe, restarts=False, exit_status=1, line=line))


def judge_eviction(failure: RankFailure, probe: FaultRecord, context: FaultContext, start: str) -> FaultRecord:
    """Every rank exited SLOW_EVICT_EXIT after a checkpoint: the ranks found a host persistently slow (its rank's log
    names it). That host leaves the job when a node may (bad_nodes.Room); the others restart from that checkpoint.
    A fault of its own kind: never "the same failure again", never a cost to run.max_restarts."""
    host = evicted_host(failure.log)
    why = f"persistently slow, evicted by the ranks (run.evict_slow: {EVICT_PREFIX}{host})"
    if host == failure.host and context.room.spare > 0:
        line = (f"fault: node {host} dropped: {failure.line()}: {why}; {context.room.carrying_on()}, from {start}; "
                f"{failure.files()}")
        return dataclasses.replace(probe, drop=True, exit_status=1, line=line)
    told = f"the ranks evicted slow host {host}" if host else "the ranks evicted a slow host"
    kept = "; no node to spare, it stays" if host == failure.host else ""
    line = f"fault: {failure.line()} ({told}{kept}); restarting from {start} (no restart spent); {failure.files()}"
    return dataclasses.replace(probe, line=line)


def judge_stuck(host: str, restarts_done: int, context: FaultContext, history: FaultHistory) -> FaultRecord:
    """torch's own verdict on a group with no failed rank: one stuck in uninterruptible sleep (D state), which it
    cannot stop; it restarts nothing."""
    tag = latest_checkpoint(context.checkpoint_dir)
    cause = "stayed in uninterruptible I/O (D state)"
    line = f"error: a rank of host {host} {cause}; no restart; resume with: {context.resume_command}"
    return _keep(history, FaultRecord(time.time(), context.job, host, restarts_done, "stuck", None, cause, None, None,
                                      context.checkpoint_name(tag) if tag else None, False, 1, 1, line))


def _keep(history: FaultHistory, record: FaultRecord) -> FaultRecord:
    history.add(record)
    return record


def hang_description(state: str) -> str:
    """A hung process's state letter from /proc (T: stopped, D: uninterruptible I/O, ...) in words."""
    return {"T": "stopped by SIGSTOP", "t": "stopped by a debugger", "D": "in uninterruptible I/O",
            "Z": "a zombie"}.get(state, "running but not progressing")
