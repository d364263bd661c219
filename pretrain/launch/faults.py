"""A failed rank, told in one line: who, how it died, where, and what happens next.

The elastic agent (pretrain/launch/agent.py) hands each failure of its worker group here. This module
decides nothing about processes; it reads the run folder (the newest checkpoint, the last failure on
record, a rank's log) and words the lines the terminal shows:

    launch.sh: fault: rank 1 (host n1) died of SIGKILL at phase1 step 12; restarting from checkpoint
        phase1-step10 (restart 1 of 3); log: RUN/logs/20260102-010203/attempt-0/rank-1.log
    launch.sh: error: rank 1 (host n1) died of SIGKILL at phase1 step 12; no restart left
        (run.max_restarts=0); last checkpoint phase1-step10; log: ...; resume with: ./launch.sh pretrain ...

Which rank is named: the rank whose hang the agent's timer caught, else one that died of a signal
other than the agent's own SIGTERM, else the first non-zero exit. The others died of its death (a
collective's peer gone, or the agent stopping them) and say so in their logs.

Kinds of failure that are no fault, and are never restarted: exit status 2 (a config, data or resume
error the ranks found: its line is shown once, and the job exits 2), 3 (NaN/inf losses, after a
checkpoint) and 4 (a checkpoint save that failed: a full disk would fail again). A failure at the same step as the last one on record, with no newer checkpoint since, is a
bug rather than a fault: restarting would fail there again, so restarts stop (RUN/logs/last_failure.json).

Standard library only (and pretrain/errors.py, the driver's exit statuses and error prefixes).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pretrain.errors import ERROR_PREFIXES, NONFINITE_EXIT, SAVE_FAILED_EXIT, USER_ERROR_EXIT

NOT_RESTARTED = {USER_ERROR_EXIT: "a config, data or resume error", NONFINITE_EXIT: "NaN/inf losses",
                 SAVE_FAILED_EXIT: "a checkpoint that could not be written (free space, then rerun)"}
START_UP = "start-up"


@dataclass(frozen=True)
class RankFailure:
    """One rank's end, as the agent saw it. `exitcode` < 0: killed by signal -exitcode."""

    rank: int
    host: str
    exitcode: int
    step: str | None  # "phase1 step 12" (the step timer it held last); None: before its first step
    log: Path
    hang: str | None = None  # "made no progress in 10 min (stopped by SIGSTOP)": its step timer ran out

    @property
    def cause(self) -> str:
        if self.hang:
            return f"{self.hang}: killed"
        if self.exitcode < 0:
            try:
                return f"died of {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"died of signal {-self.exitcode}"
        return f"exited with status {self.exitcode}"

    @property
    def where(self) -> str:
        return f"at {self.step}" if self.step else f"during {START_UP}"

    @property
    def exit_status(self) -> int:
        """What the job exits with when this failure ends it: the shell's 128 + signal, or the exit code."""
        return 128 - self.exitcode if self.exitcode < 0 else self.exitcode

    def line(self) -> str:
        return f"rank {self.rank} (host {self.host}) {self.cause} {self.where}"


def primary_failure(failures: list[RankFailure]) -> RankFailure:
    """The failure that ended the group (module docstring): a hang, then a signal other than SIGTERM
    (the agent's own), then a user error, then the first non-zero exit by rank."""
    def order(failure: RankFailure) -> tuple[int, int]:
        if failure.hang:  # a frozen rank before one that only waited for it in a collective
            return (0 if "(stopped" in failure.hang else 1, failure.rank)
        if failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM:
            return (2, failure.rank)
        if failure.exitcode in NOT_RESTARTED:
            return (3, failure.rank)
        return (4 if failure.exitcode > 0 else 5, failure.rank)

    return min(failures, key=order)


def latest_checkpoint(checkpoint_dir: Path) -> str | None:
    """The tag `latest` names (what a restart resumes from), or None before the first checkpoint."""
    try:
        return (checkpoint_dir / "latest").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def error_line(log: Path) -> str | None:
    """The last line of a rank's log that pretrain.train prints for a user error ("config error: ...")."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    return next((line.strip() for line in reversed(lines) if line.startswith(ERROR_PREFIXES)), None)


@dataclass
class FailureRecord:
    """RUN/logs/last_failure.json: the step and checkpoint of the last failure, kept across restarts and
    launches, so that a failure repeating at the same step with no progress since stops the restarts."""

    path: Path

    def repeats(self, failure: RankFailure, checkpoint: str | None) -> bool:
        try:
            last = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return last.get("step") == (failure.step or START_UP) and last.get("checkpoint") == checkpoint

    def clear(self) -> None:
        """A run that finished: the next failure starts a new record."""
        self.path.unlink(missing_ok=True)

    def save(self, failure: RankFailure, checkpoint: str | None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"step": failure.step or START_UP, "checkpoint": checkpoint,
                                         "rank": failure.rank, "cause": failure.cause}), encoding="utf-8")
        os.replace(temporary, self.path)


@dataclass(frozen=True)
class FaultContext:
    """What a fault line needs besides the failure: the run's restart budget, where checkpoints are, the
    command that resumes."""

    max_restarts: int
    checkpoint_dir: Path
    resume_command: str


@dataclass(frozen=True)
class Verdict:
    """What the agent does about one failure: restart or not, the line to print, the job's exit status."""

    restart: bool
    line: str
    exit_status: int


def judge(failure: RankFailure, restarts_done: int, context: FaultContext, record: FailureRecord) -> Verdict:
    """Restart (with its one line) or stop (with the one error line and the status the job exits with)."""
    checkpoint = latest_checkpoint(context.checkpoint_dir)
    start = f"checkpoint {checkpoint}" if checkpoint else "the start (no checkpoint yet)"
    log = f"log: {failure.log}"
    if failure.exitcode in NOT_RESTARTED:
        found = error_line(failure.log)
        if found and failure.exitcode == USER_ERROR_EXIT:
            return Verdict(False, found, USER_ERROR_EXIT)
        return Verdict(False, f"error: {failure.line()}: {NOT_RESTARTED[failure.exitcode]}, not restarted"
                              f"{': ' + found if found else ''}; {log}", failure.exit_status)
    if record.repeats(failure, checkpoint):
        why = (f"the same failure as the last one, at the same step with no newer checkpoint: a bug, not a fault, "
               f"so no restart; last checkpoint {checkpoint or 'none'}")
    elif restarts_done >= context.max_restarts:
        why = (f"no restart left (run.max_restarts={context.max_restarts}); last checkpoint "
               f"{checkpoint or 'none'}")
    else:
        record.save(failure, checkpoint)
        return Verdict(True, f"fault: {failure.line()}; restarting from {start} (restart {restarts_done + 1} of "
                             f"{context.max_restarts}); {log}", 0)
    record.save(failure, checkpoint)
    # status 1, not the rank's: over a hostfile, a status >= 128 from a node means the node was lost (nodes.py)
    return Verdict(False, f"error: {failure.line()}; {why}; {log}; resume with: {context.resume_command}", 1)


def hang_description(state: str) -> str:
    """A hung process's state letter from /proc (T: stopped, D: uninterruptible I/O, ...) in words."""
    return {"T": "stopped by SIGSTOP", "t": "stopped by a debugger", "D": "in uninterruptible I/O",
            "Z": "a zombie"}.get(state, "running but not progressing")


def process_state(pid: int, proc: Path = Path("/proc")) -> str:
    """The state letter of /proc/PID/stat ("" when unreadable)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[0] if ")" in stat else ""


def worker_env_extras(local_size: int, node_rank: int, nodes: int) -> Mapping[str, str]:
    """What DeepSpeed's own launcher gives each rank beyond torch's variables: its CPU all-reduce reads
    LOCAL_SIZE to use shared memory; CROSS_RANK / CROSS_SIZE say which node."""
    return {"LOCAL_SIZE": str(local_size), "CROSS_RANK": str(node_rank), "CROSS_SIZE": str(nodes)}
