"""The fault record: the one form in which a judged fault is kept (RUN/logs/faults/, one file each, read by every
node: pretrain/launch/faults.py FaultHistory) and handed on (one JSON line to pretrain/launch/nodes.py); and an
agent's last word under nodes.py; and FaultLines, which makes the nodes' records of one fault one line.

pretrain/launch/faults.py judges failures into records. Standard library only: the ground floor, so that the
modules that read records sit no higher for it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, ClassVar, Self

PREFIX = "launch.sh"
RECORD_PREFIX = "launch.sh: fault record: "  # an agent's record on its stdout, for pretrain/launch/nodes.py
VICTIM_ORDER = 5  # failure_order of a rank that died of another's failure (pretrain/launch/faults.py)


@dataclass(frozen=True)
class FaultRecord:
    """One judged fault: what the terminal showed, and the data a report needs to cost it."""

    time: float  # when the agent judged it (seconds since the epoch)
    job: str  # the launch's rendezvous id: the nodes of one launch share it
    host: str
    restart: int  # restarts of this launch before it (0: its first attempt)
    kind: str  # hang | signal | exit | node | config | nonfinite | save | stuck | slow
    rank: int | None
    cause: str  # "died of SIGKILL", "made no progress in 10 min (...): killed"
    step: str | None  # the timer the rank held: "phase1 step 12", "start-up", ...
    detail: str | None  # the rank's own error line, else the last exception in its log
    checkpoint: str | None  # what `latest` named: the checkpoint a restart resumes from (None: the start)
    restarts: bool  # the verdict: the job restarts (True) or stops
    exit_status: int  # the job's status when it stops here
    order: int  # how telling (failure_order): VICTIM_ORDER and above, a rank that died of another's failure
    line: str  # the terminal line, without "launch.sh: "
    failed_at: float | None = None  # when the rank failed, as near as its agent could tell (RankFailure.failed_at)
    # how long the failure went unseen before its agent acted: a hang's limit that ran out (the rank's last progress
    # was that long before its timer fired); 0 for a death, seen within the agent's 0.2 s poll
    detection_s: float = 0.0
    # the verdict that `host` leaves the job (a bad or slow node under --nodes MIN:MAX, pretrain/launch/bad_nodes.py):
    # its agent ends without restarting, the others restart without it; such an attempt spends no restart
    drop: bool = False

    @property
    def victim(self) -> bool:
        """A rank that died of another's failure (a lost peer, NCCL's abort, its agent's stop): never "the same
        failure again", however often it comes; the culprit's record says what happened."""
        return self.order >= VICTIM_ORDER

    @property
    def telling(self) -> tuple[int, float]:
        """How one record is chosen among several of one attempt (the nodes' lines): the most telling failure, then
        the earliest; never the lower rank (rank numbers say nothing of what failed first)."""
        return self.order, self.failed_at if self.failed_at is not None else self.time

    @property
    def key(self) -> tuple[str, str, str | None, str | None]:
        """What "the same failure" means: the same kind, cause, step and error line."""
        return self.kind, self.cause, self.step, self.detail

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FaultRecord:
        fields = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in json.loads(text).items() if name in fields})

    @classmethod
    def from_line(cls, line: str) -> FaultRecord | None:
        """The record an agent printed as one line (RECORD_PREFIX + JSON), anywhere in `line` (pdsh puts the host in
        front); None for any other line."""
        _, found, text = line.partition(RECORD_PREFIX)
        if not found:
            return None
        try:
            return cls.from_json(text)
        except (ValueError, TypeError):
            return None


def attempt_culprit(records: list[FaultRecord]) -> FaultRecord | None:
    """The record that speaks for one attempt: of every node's records of it, the most telling (its order, then the
    earliest failure; FaultRecord.telling). What "the same failure again" compares a new fault with, so that a node
    whose ranks only lost their peer (a victim, whatever its text) is never compared with its own earlier record: a
    healthy node's repeated line is never "a bug". None: no record."""
    return min(records, key=lambda record: record.telling, default=None)


class AgentWord:
    """A dataclass an agent prints as one line, PREFIX + its fields as JSON, for pretrain/launch/nodes.py to read back
    anywhere in a line (pdsh puts the host in front): AgentEnd, joins.JoinNote."""

    PREFIX: ClassVar[str] = ""

    def to_line(self) -> str:
        return f"{self.PREFIX}{json.dumps(dataclasses.asdict(self))}"

    @classmethod
    def from_line(cls, line: str) -> Self | None:
        """The word in `line`; None for any other line or one that does not parse."""
        _, found, text = line.partition(cls.PREFIX)
        try:
            return cls(**json.loads(text)) if found else None
        except (ValueError, TypeError):
            return None


@dataclass(frozen=True)
class AgentEnd(AgentWord):
    """An agent's last word under pretrain/launch/nodes.py: its node and the status it exits with. A node whose agent
    said it ended by itself; whatever its transport reports after (srun's "Out Of Memory" for a rank the kernel
    killed earlier), it is no lost node."""

    host: str
    status: int
    line: str = ""  # its own error line when it ends before its ranks ran (a config it could not read)
    leaves: str = ""  # why its node leaves the job for good (a rank SIGKILL cannot end): excluded on a requeue

    PREFIX = "launch.sh: agent end: "


class FaultLines:
    """One line per fault, not one per node: every node's agent judges the failure its own ranks saw (on the node of
    the rank that died: "died of SIGKILL"; on the others: "exited with status 1", their ranks having lost a peer) and
    sends its FaultRecord. The records of one attempt are held until every running node has sent its own, or
    `settle_s` passed, or until a later event (a later attempt's record, a lost node) must follow it; then one line is
    shown: a final verdict's if any node reached one (it ends the job), else a node's drop (its host leaves the job,
    the others restart without it), else the most telling (FaultRecord.telling:
    its order, then the earliest failure, never the lower rank), with the node's name in front as pdsh put it. A
    victim's record (a rank that lost its peer) reaches no final verdict of its own but a spent budget, which every
    node reaches alike (pretrain/launch/faults.py), so the line names the culprit."""

    def __init__(self, out: IO[str], nodes_running: Callable[[], int], settle_s: float = 10.0) -> None:
        self.out, self.nodes_running, self.settle_s = out, nodes_running, settle_s
        self.pending: dict[tuple[str, int], list[tuple[str, FaultRecord]]] = {}
        self.shown: set[tuple[str, int]] = set()  # an attempt told already: a node's late word on it is dropped
        self.lock = threading.Lock()

    def offer(self, line: str) -> bool:
        """Hold `line` when it is a node's fault record (True), else leave it to the caller."""
        record = FaultRecord.from_line(line)
        if record is None:
            return False
        key = (record.job, record.restart)
        for earlier in [other for other in list(self.pending) if other[0] == key[0] and other[1] < key[1]]:
            self.show(earlier)  # a later attempt's word: the earlier fault is told first, with what it has
        with self.lock:
            if key in self.shown:
                return True
            first = key not in self.pending
            self.pending.setdefault(key, []).append((line.partition("launch.sh: ")[0], record))
            complete = len(self.pending[key]) >= self.nodes_running()
        if complete:
            self.show(key)
        elif first:
            timer = threading.Timer(self.settle_s, self.show, args=(key,))
            timer.daemon = True
            timer.start()
        return True

    def show(self, key: tuple[str, int]) -> None:
        with self.lock:
            told = self.pending.pop(key, [])
            self.shown.add(key)
        final = [(node, record) for node, record in told if not record.restarts]
        dropping = [(node, record) for node, record in told if record.drop]
        if told:
            chosen = attempt_culprit([record for _, record in final or dropping or told])
            node, record = next(pair for pair in told if pair[1] is chosen)
            self.out.write(f"{node}{PREFIX}: {record.line}\n")
            self.out.flush()

    def show_all(self) -> None:
        for key in list(self.pending):
            self.show(key)
