"""Which nodes joined the rendezvous, as their agents tell pretrain/launch/nodes.py: a node that has not joined after
the others' last call is named in one line, and stopped (or left behind under --nodes MIN:MAX).

An agent that ends before it joins (a missing mount) says so (AgentEnd), and nodes.py acts at once. An agent that
hangs before it joins (its interpreter stuck on a stale mount, imports from a cold file system) says nothing, and
without --nodes MIN:MAX the others would wait in the rendezvous for torch's join timeout (600 s), and then end with
no word of the node they waited for. So each agent says when it begins to wait for a round and when a round took it
(JoinNote, one JSON line each, pretrain/launch/agent.py). JoinWatch reads them:

- a node that has not begun to wait `grace_s` after another began to (its last call, run.last_call_seconds, or
  NOT_JOINED_S when that is longer: agents start at different times) while the job needs it: named, and the job
  stops (nodes.py: one error line, the waiting nodes stopped, the silent one's agent ended);
- under --nodes MIN:MAX the round goes on without it after its last call: the node is named in one warning line
  (`left behind`); it joins at the next round if it ever comes, at the cost of a restart of the running nodes.

Standard library only, as nodes.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pretrain.launch.fault_records import AgentWord

# the least a node that waits in the rendezvous waits for a silent one before it is named: longer than another
# node's wait for a rank SIGKILL cannot end (survivors.STUCK_AFTER_S), which ends with its own line
NOT_JOINED_S = 180.0


@dataclass(frozen=True)
class JoinNote(AgentWord):
    """An agent's word on the rendezvous: it begins to wait for a round (`nodes` 0), or a round of `nodes` took it;
    `last_call_s`: its run.last_call_seconds."""

    host: str
    nodes: int = 0
    last_call_s: float = 30.0

    PREFIX = "launch.sh: rendezvous: "


@dataclass
class JoinWatch:
    """The agents' notes as they come (`note`), and what they say of the nodes that have not joined (`silent`,
    `left_behind`). Times are the caller's clock (monotonic seconds)."""

    waiting: dict[str, float] = field(default_factory=dict)  # host -> since when it waits for a round
    joined: dict[str, float] = field(default_factory=dict)  # host -> when a round last took it
    rounds: list[tuple[float, int]] = field(default_factory=list)  # (when, its nodes): rounds not yet checked
    last_call_s: float = 30.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def grace_s(self) -> float:
        return max(NOT_JOINED_S, 2 * self.last_call_s)

    def note(self, note: JoinNote, now: float) -> None:
        with self.lock:
            self.last_call_s = note.last_call_s
            if note.nodes:
                self.waiting.pop(note.host, None)
                self.joined[note.host] = now
                if not self.rounds or now - self.rounds[-1][0] > 1.0:
                    self.rounds.append((now, note.nodes))
            else:
                self.waiting[note.host] = now

    def silent(self, running: Sequence[str], now: float) -> list[str]:
        """The nodes of `running` that have not begun to wait while another has waited longer than grace_s: in the
        job's first round, the nodes that never said a word; later, those that did not come back to wait."""
        with self.lock:
            if not self.waiting or now - min(self.waiting.values()) < self.grace_s:
                return []
            since = min(self.waiting.values())
            return [host for host in running if host not in self.waiting and self.joined.get(host, -1.0) < since]

    def left_behind(self, running: Sequence[str], now: float, settle_s: float = 2.0) -> tuple[list[str], int]:
        """After a round that took fewer nodes than are running (settled for `settle_s`): the nodes it did not take,
        and its size; ([], 0) when none (each round is checked once)."""
        with self.lock:
            if not self.rounds or now - self.rounds[0][0] < settle_s:
                return [], 0
            when, nodes = self.rounds.pop(0)
            if nodes >= len(running):
                return [], 0
            return [host for host in running if self.joined.get(host, -1.0) < when], nodes


def watch_joins(joins: JoinWatch, running: Callable[[], list[str]], strict: bool, act: Callable[[list[str], int], None],
          ended: threading.Event, clock: Callable[[], float] = time.monotonic, tick_s: float = 1.0) -> None:
    """Until `ended`: each `tick_s`, the nodes of `running()` that have not joined, handed to `act(hosts, nodes)`:
    without MIN:MAX (`strict`) the silent ones once (nodes 0: the job stops), else those a round left behind."""
    while not ended.wait(tick_s):
        now = clock()
        if strict:
            silent = joins.silent(running(), now)
            if silent:
                act(silent, 0)
                return
        else:
            behind, nodes = joins.left_behind(running(), now)
            if behind:
                act(behind, nodes)
