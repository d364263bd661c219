"""How an agent's run ends: its status and its one line, whatever ended it (pretrain/launch/agent.py runs it).

A run that ended (every rank's outcome: 0, or the fault's status), a stop (between two attempts, or while a fault
was handled: 0, 130 for Ctrl-C, with the command that resumes from the newest checkpoint, `latest`), another node's
final verdict (its rendezvous closed: 1, that node told it), a rendezvous that failed, a rank that SIGKILL cannot end
(survivors.NodeUnhealthy: the host to drain; under nodes.py the rendezvous is left open, so under --nodes MIN:MAX
the others carry on without it as without a lost node), this node's own verdict that it leaves the job (a bad or slow
host, pretrain/launch/bad_nodes.py: the rendezvous is left open too), or a full disk or spent quota met at a restart (the
attempt's log folder could not be made: the free-space line, never a traceback). The rendezvous is closed otherwise,
whatever the end, so no other node waits in it.
"""

from __future__ import annotations

import errno
import signal
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

from pretrain.launch.survivors import NodeUnhealthy

PREFIX = "launch.sh"
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full file system, a spent quota: freeing space fixes them


def say(line: str) -> None:
    print(f"{PREFIX}: {line}", file=sys.stderr, flush=True)


def run(agent: Any) -> int:
    """The agent's run, its rendezvous closed whatever the end (no other node waits in it), and its status."""
    resume = agent.judging.context.resume_command
    close = True  # the rendezvous: closed, but by a node that leaves it to the others (nodes.py decides)
    try:
        result = agent.run()
        close = not agent.leaving  # a node dropped by its own verdict: the others go on in the rendezvous
    except SignalException as stopped:  # between two attempts, or while a fault was handled: no rank to checkpoint
        agent.stop_signal = agent.stop_signal or stopped.sigval
        say(f"stopped by {signal.Signals(agent.stop_signal).name} {stopped.args[0]}; the same command resumes from "
            f"the newest checkpoint: {resume}")
        return agent.exit_status
    except NodeUnhealthy as unhealthy:  # under nodes.py its AgentEnd goes on: the job carries on without this node
        agent.last_word = f"{unhealthy.line} with: {resume}"  # under --nodes MIN:MAX, else it stops the others
        agent.leaves = unhealthy.line  # for good: a SLURM requeue starts no agent there
        say(agent.last_word)
        close = not agent.node.under_nodes
        return 1
    except OSError as err:
        if err.errno not in SPACE_ERRNOS:
            raise
        agent.last_word = (f"error: host {agent.node.host}: the run folder's file system is full or its quota spent "
                           f"({err}); free space there, then resume with: {resume}")
        say(agent.last_word)
        return 1
    except RendezvousClosedError:  # another node's final verdict ended the job; that node told it
        return 1
    except RendezvousError as err:
        say(f"error: host {agent.node.host}: the rendezvous failed ({type(err).__name__}: {err}); resume with: "
            f"{resume}")
        return 1
    finally:
        try:
            handler = agent.get_worker_group().spec.rdzv_handler
            if close:
                handler.shutdown()
            else:
                leave(handler)
        except Exception:  # noqa: BLE001 - a store already gone has nothing left to close or leave
            pass
        agent.watch.stop()
    if result.is_failed() and agent.stop_signal is not None and agent.record is None:
        say(f"stopped by {signal.Signals(agent.stop_signal).name} while a fault was handled; the same command "
            f"resumes from the newest checkpoint: {resume}")
    return 0 if not result.is_failed() else agent.exit_status


def leave(handler: Any) -> None:
    """This node out of the rendezvous, which stays open to the others (a node that leaves the job): torch's own exit
    operation, as a node runs before it joins a new round, so the others' next round need not wait for this node's
    heartbeats to lapse (about 15 s). torch internals (the dynamic handler's op executor, its exit op, its deadline);
    where they differ, the heartbeats lapse as before."""
    handler._stop_heartbeats()
    handler._op_executor.run(_RendezvousExitOp(), handler._get_deadline(handler._settings.timeout.close))
