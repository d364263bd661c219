"""Ending a node's ranks at a fault: their stacks first (bounded), then SIGKILL, then a bounded wait until they are gone.

A fault anywhere in the job ends every rank of every node: one that lost its peer cannot finish a step, nor the
checkpoint a SIGTERM would ask of it (our ranks read SIGTERM as a user's stop, and a rank blocked in an NCCL
collective with a dead peer never sees it). torch would stop them with SIGTERM and a 30 s grace, on the culprit's
node (its poll) and on every other (its healthy-group restart, when the culprit's agent waits in the rendezvous);
that grace would be spent in full at each fault. Here they give their stacks (hang_watch.ask_for_stacks:
STACKS_WAIT_S, more on GPUs for NCCL's trace) and are killed at once, on every node alike.

A rank still there after SIGKILL past `stuck_s` (uninterruptible sleep after a driver fault or a hung file system:
no signal ends it) holds its GPU: a restart there would fail at start-up, so the node is unhealthy, and the job ends
with one line naming the node to drain (NodeUnhealthy).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field

from pretrain.launch.faults import hang_description
from pretrain.launch.hang_watch import HangWatch, ask_for_stacks
from pretrain.launch.processes import kill, process_state, wait_until_gone

STUCK_AFTER_S = 120.0  # how long a rank may take to vanish after SIGKILL (a GPU context's teardown) before its node
#                        is judged unhealthy: a minute or two, as a driver's own recovery takes
LOG = logging.getLogger("torch.distributed.elastic")  # the agent's log (rank_logs.quiet_torch_logs): agent.log


class NodeUnhealthy(Exception):
    """A rank of this node that SIGKILL cannot end: the job ends here, its line naming the node to drain."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


@dataclass(frozen=True)
class NodeSettings:
    """This node's part: its name in the lines, the job's --nodes MIN:MAX, whether nodes.py reads its records, torch's
    grace for a stop, and how its ranks are ended at a fault: asked for their stacks first (run.survivor_stacks), and
    after how long one still there after SIGKILL is a stuck rank."""

    host: str
    min_nodes: int = 1
    max_nodes: int = 1
    under_nodes: bool = False
    shutdown_timeout: int = 30
    stacks: bool = True
    stuck_s: float = STUCK_AFTER_S


@dataclass
class Ended:
    """What ending them did: the pids asked for stacks, those still there after `stuck_s`, and how long it took."""

    asked: set[int] = field(default_factory=set)
    left: list[int] = field(default_factory=list)
    seconds: float = 0.0


def end_ranks(pids: list[int], watch: HangWatch, ending: NodeSettings, why: str) -> Ended:
    """Stacks (when asked for), SIGKILL, and the wait until every one of `pids` is gone; one line in agent.log saying
    why, how, and how long the stop took. Raises NodeUnhealthy when one is still there after `ending.stuck_s`."""
    began = time.monotonic()
    asked = ask_for_stacks(pids, watch.ranks) if ending.stacks else set()
    watch.stacks |= asked
    for pid in pids:
        kill(pid, signal.SIGKILL)
    left = wait_until_gone(pids, ending.stuck_s)
    ended = Ended(asked, left, time.monotonic() - began)
    LOG.warning("ranks ended: pid %s (%s): stacks asked of %d, then SIGKILL; gone in %.2f s",
                ", ".join(map(str, pids)), why, len(asked), ended.seconds)
    if left:
        raise NodeUnhealthy(unhealthy_line(ending, left))
    return ended


def unhealthy_line(ending: NodeSettings, left: list[int]) -> str:
    state = hang_description(process_state(left[0]))
    return (f"error: host {ending.host}: rank pid {', '.join(map(str, left))} still there {ending.stuck_s:g} s after "
            f"SIGKILL ({state}): its GPU cannot be given to a restart; drain host {ending.host} (SLURM: scontrol "
            f"update nodename={ending.host} state=drain reason=stuck-rank), leave it out of the hostfile, and resume")
