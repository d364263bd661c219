"""When a node leaves the job: a bad or slow host dropped under `--nodes MIN:MAX`, decided where its fault is judged.

A GPU that fails at every start (an Xid, an ECC error, memory a dead process still holds), a link that fails every
hour, a GPU that throttles: each restart lands on the same host again, and the job spends its restarts, or ends as
"the same failure again: a bug", on one machine's fault. With `--nodes MIN:MAX` and a node to spare (more nodes in
the world than MIN), the host leaves the job instead, with one line naming it and why, and the others restart from
the newest checkpoint without it (pretrain/launch/faults.py judge asks `drop_reason` before any other verdict but a
rank's own error). A host is dropped when its own rank (never a victim's record: that is its peer's doing):

- fails the same way as the attempt before's culprit, on the same host with no newer checkpoint between: a drop
  before it is "the same failure again ... a bug" (a bug fails on any host; the same host again is its hardware);
- fails DROP_AFTER times at start-up or at the first step after a resume (the step right after the checkpoint it
  resumed from) with no newer checkpoint between: a GPU that cannot take a start;
- has had `HostFaults.limit` faults of its own within `HostFaults.hours` (run.host_fault_limit, run.host_fault_hours),
  this one included, whatever progress was made between: a flaky link or GPU that would otherwise cost a recovery
  every hour for as long as the job runs;
- or was evicted by the ranks as persistently slow (every rank exits SLOW_EVICT_EXIT after a checkpoint, the slow
  rank's log says EVICT_PREFIX + its host: pretrain/metrics/slow_ranks.py, run.evict_slow). That exit is a fault of
  its own kind, "slow": never "a bug", never a cost to run.max_restarts.

The ranks learn whether a node may leave now from pretrain/errors.py's NODES_SPARE_ENV (Room.spare), set by the agent at each round, and
their node's name as the launcher's lines give it from NODE_NAME_ENV (the name `evicting host` must carry).
Without room (no MIN:MAX, or MIN nodes left) the verdicts are those of faults.py as before. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pretrain.errors import EVICT_PREFIX
from pretrain.launch.fault_records import FaultRecord
from pretrain.launch.fault_texts import log_lines

DROP_AFTER = 2  # failures of a host's own rank at start-up or the first step after a resume, no progress between
_STEP = re.compile(r"^(\S+) step (\d+)$")
_TAG = re.compile(r"(?:^|/)([A-Za-z0-9_]+)-step0*(\d+)$")
_EVICTED = re.compile(re.escape(EVICT_PREFIX) + r"(\S+)")


@dataclass(frozen=True)
class Room:
    """The nodes of the world that failed and the job's --nodes MIN:MAX: how many of them may leave now."""

    nodes: int = 1
    low: int = 1
    high: int = 1

    @property
    def spare(self) -> int:
        return max(0, self.nodes - self.low) if self.low < self.high else 0

    def carrying_on(self) -> str:
        return f"carrying on with {self.nodes - 1} node(s) (--nodes {self.low}:{self.high})"


@dataclass(frozen=True)
class HostFaults:
    """The per-host fault-rate guard: `limit` faults of a host's own within `hours` drop it (0: never)."""

    limit: int = 3
    hours: float = 6.0


def at_start(step: str | None, checkpoint: str | None) -> bool:
    """Whether a failure at `step` came at start-up (no training step yet: start-up, the resume checks, a set-up) or
    at the first step after resuming from `checkpoint` (its step + 1; step 1 of a phase with none of that phase)."""
    found = _STEP.match(step or "")
    if found is None:
        return True
    tag = _TAG.search(checkpoint or "")
    if tag is not None and tag[1] == found[1]:
        return int(found[2]) == int(tag[2]) + 1
    return int(found[2]) == 1


def evicted_host(log: Path) -> str | None:
    """The host a rank's log names after EVICT_PREFIX (the ranks' verdict on a persistently slow host), the last
    such line; None: none."""
    named = [found[1] for line in log_lines(log) for found in [_EVICTED.search(line)] if found]
    return named[-1] if named else None


def drop_reason(record: FaultRecord, culprit: FaultRecord | None, mine: list[FaultRecord], room: Room,
                faults: HostFaults) -> str | None:
    """Why `record`'s host leaves the job (module docstring), or None. `culprit`: the attempt before's (every node's
    most telling record); `mine`: the earlier records of this host, this launch's and the one before's."""
    if record.victim or room.spare < 1:
        return None
    own = [r for r in mine if r.host == record.host and not r.victim and r.kind != "slow"]
    if (culprit is not None and not culprit.victim and culprit.host == record.host and culprit.key == record.key
            and culprit.checkpoint == record.checkpoint):
        return "the same failure as at the start before, on this host, with no newer checkpoint"
    if at_start(record.step, record.checkpoint):
        starts = 1 + sum(r.checkpoint == record.checkpoint and at_start(r.step, r.checkpoint) for r in own)
        if starts >= DROP_AFTER:
            return (f"its rank failed at {starts} starts with no newer checkpoint between (start-up or the first "
                    "step after a resume)")
    if faults.limit > 0:
        count = 1 + sum(r.time >= record.time - faults.hours * 3600 for r in own)
        if count >= faults.limit:
            return (f"{count} faults of its own in {faults.hours:g} h (run.host_fault_limit={faults.limit}, "
                    f"run.host_fault_hours={faults.hours:g})")
    return None
