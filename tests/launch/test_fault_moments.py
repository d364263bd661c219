"""The agent's own run loop (torch's LocalElasticAgent under HealingAgent, a real rendezvous, real rank processes) at
the moments of a fault's handling: how the ranks of a node are ended (pretrain/launch/survivors.py), on the culprit's
node and on torch's healthy-group path (another node's rank failed), and a stop that comes at each moment.

The ranks are small Python processes that behave as ours do where it matters: a SIGTERM is a stop request they note
(in a file) and act on later, STACKS_SIGNAL writes their stacks (step_watch.dump_stacks_on_signal), and one of them
fails at the first attempt. No timing is asserted: what ended the ranks (their exit signal, whether they saw a
SIGTERM, their stacks) and what the agent says and returns.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

from pretrain.config.sections import RunConfig
from pretrain.launch import agent as agent_module
from pretrain.launch.agent import TORCH_ATTEMPTS, HealingAgent, Judging
from pretrain.launch.faults import FaultContext, FaultHistory
from pretrain.launch.hang_watch import Limits, watch_ranks
from pretrain.launch.processes import ended_badly
from pretrain.launch.rank_logs import RankLogs, quiet_torch_logs
from pretrain.launch.survivors import NodeSettings, NodeUnhealthy, end_ranks
from tests.support.launching import free_port
from tests.support.paths import REPO_ROOT

# A rank: notes a SIGTERM in stop-<rank> (as StopRequest does, acting on it later), gives its stacks on STACKS_SIGNAL,
# says it is ready, then: at the first attempt rank FAIL_RANK exits 1, the others wait (a collective with a dead peer);
# at a restart every rank ends at once, status 0.
RANK = """
import os, signal, sys, time
from pathlib import Path
from pretrain.distributed.step_watch import dump_stacks_on_signal
folder, rank = Path(sys.argv[1]), os.environ["RANK"]
dump_stacks_on_signal()
signal.signal(signal.SIGTERM, lambda *_: (folder / f"stop-{rank}").write_text("stop"))
(folder / f"ready-{rank}-{os.environ['TORCHELASTIC_RESTART_COUNT']}").write_text("")
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    sys.exit(0)
if rank == os.environ.get("FAIL_RANK"):
    time.sleep(0.5)
    sys.exit(1)
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def agent_env(tmp_path: Path) -> Iterator[Path]:
    """The variables watch_ranks and the ranks need, restored after (they are the agent process's own)."""
    saved = dict(os.environ)
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher")]
    kept = [(logger, logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    os.environ["PYTHONPATH"] = str(REPO_ROOT)
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)
    for logger, handlers, level, propagate in kept:  # quiet_torch_logs sent them to this test's agent.log
        for handler in logger.handlers:
            handler.close()
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


def make_agent(folder: Path, kind: type[HealingAgent] = HealingAgent, **node: Any) -> HealingAgent:
    """The agent as build_agent makes it (its judging, timers, logs, node settings), on torch's static rendezvous
    (one node) and our small ranks."""
    launch_dir = folder / "logs" / "launch"
    launch_dir.mkdir(parents=True)
    quiet_torch_logs(launch_dir / "agent.log")
    watch = watch_ranks(Limits(600.0, 600.0), launch_dir)
    params = RendezvousParameters(backend="static", endpoint=f"127.0.0.1:{free_port()}", run_id="moments",
                                  min_nodes=1, max_nodes=1, rank=0)
    spec = WorkerSpec(role="rank", local_world_size=2, entrypoint=sys.executable, args=("-c", RANK, str(folder)),
                      rdzv_handler=create_rdzv_handler(params), max_restarts=TORCH_ATTEMPTS, monitor_interval=0.05)
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "latest").write_text("phase1-step0000010\n")
    context = FaultContext("moments", 3, folder, folder / "checkpoints", "./launch.sh pretrain --config run.json")
    judging = Judging(RunConfig(), context, FaultHistory(folder / "logs" / "faults"))
    settings = NodeSettings(node.pop("host", "node0"), shutdown_timeout=2, **node)
    return kind(spec, RankLogs(launch_dir), judging, watch, settings)


def wait_for(what: str, check: Any, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"waited {limit_s} s for {what}"
        time.sleep(0.05)


def start_group(agent: HealingAgent, folder: Path) -> dict[int, Any]:
    """The first attempt's ranks, started by torch's own _initialize_workers, once each has said it is ready."""
    agent._initialize_workers(agent.get_worker_group())
    wait_for("the ranks to start", lambda: all((folder / f"ready-{r}-0").exists() for r in (0, 1)))
    return dict(agent._pcontext.subprocess_handlers)


def test_a_healthy_group_restarted_for_another_nodes_fault_gives_its_stacks_and_is_killed_not_sigtermed(
        agent_env: Path) -> None:
    """Another node's rank failed; this node's ranks are healthy and torch restarts them (a node waits in the
    rendezvous). Before, torch's _stop_workers sent them SIGTERM, which they took for a user's stop, and SIGKILL
    after its grace. Now they give their stacks and die of SIGKILL, never told to stop; the agent's log says so."""
    folder = agent_env
    agent = make_agent(folder)
    try:
        handlers = start_group(agent, folder)
        group = agent.get_worker_group()
        assert group.state == WorkerState.HEALTHY
        agent._restart_workers(group)  # what torch's run loop calls on a healthy group with a node waiting
        wait_for("the restart's ranks", lambda: all((folder / f"ready-{r}-1").exists() for r in (0, 1)))
    finally:
        agent._shutdown(timeout=2)
        agent.watch.stop()
    assert {handler.proc.returncode for handler in handlers.values()} == {-signal.SIGKILL}
    assert not list(folder.glob("stop-*")), "a rank was sent SIGTERM: it would have tried to checkpoint"
    logs = [RankLogs(folder / "logs" / "launch").path(0, rank).read_text() for rank in (0, 1)]
    assert all("Most recent call first" in log or "File " in log for log in logs), logs
    agent_log = (folder / "logs" / "launch" / "agent.log").read_text()
    assert "ranks ended" in agent_log and "then SIGKILL" in agent_log, agent_log


def test_a_rank_that_sigkill_cannot_end_marks_its_node_unhealthy_with_one_line_naming_it(agent_env: Path) -> None:
    """pid 1 stands for a rank in uninterruptible sleep: the kernel never lets SIGKILL end it (an init process only
    gets the signals it handles; not ours, where the tests do not run as root)."""
    launch_dir = agent_env / "launch"
    launch_dir.mkdir()
    watch = watch_ranks(Limits(600.0, 600.0), launch_dir)
    try:
        with pytest.raises(NodeUnhealthy) as raised:
            end_ranks([1], watch, NodeSettings("gpu-n7", stacks=False, stuck_s=0.2), "a test")
    finally:
        watch.stop()
    line = raised.value.line
    assert line.startswith("error: host gpu-n7: rank pid 1 still there") and "drain host gpu-n7" in line, line
    assert "\n" not in line


class StoppedAt(HealingAgent):
    """The agent, with the user's stop (what its SIGTERM handler calls: forward) delivered at one moment."""

    moment = ""

    def stop_here(self, moment: str) -> None:
        if moment == self.moment and self.stop_signal is None:
            self.forward(signal.SIGTERM)

    def _end_survivors_of_a_fault(self) -> None:
        if any(ended_badly(pid) for pid in self.pids().values()):
            self.stop_here("a rank died, before the survivors are ended")
        super()._end_survivors_of_a_fault()

    def _judge(self, result: Any) -> None:
        super()._judge(result)
        self.stop_here("the fault judged, before the restart")

    def _rendezvous(self, worker_group: Any) -> None:
        if worker_group.state != WorkerState.INIT:
            self.stop_here("in the restart's rendezvous")
        super()._rendezvous(worker_group)


MOMENTS = ("a rank died, before the survivors are ended", "the fault judged, before the restart",
           "in the restart's rendezvous")


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_stop_at_any_moment_of_a_faults_handling_ends_like_a_stop_between_attempts(
        agent_env: Path, moment: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Rank 1 exits 1; a SIGTERM reaches the agent at `moment`. Before, it exited 143 (128 + SIGTERM) before the
    restart, or the restart ran on and the stop was lost. Now: status 0 (a SLURM time-limit stop is requeued), no
    restart, one line with the command that resumes from the checkpoint that `latest` still names."""
    folder = agent_env
    os.environ["FAIL_RANK"] = "1"
    kind = type("Agent", (StoppedAt,), {"moment": moment})
    agent = make_agent(folder, kind)
    status = agent_module.run(agent)
    err = capfd.readouterr().err
    assert status == 0, err
    assert not list(folder.glob("ready-*-1")), "the ranks were restarted after the stop"
    stopped = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1 and "resumes from the newest checkpoint: ./launch.sh pretrain" in stopped[0], err
    assert (folder / "checkpoints" / "latest").read_text() == "phase1-step0000010\n"


class WithAStuckRank(HealingAgent):
    """pid 1 among its ranks: a rank in uninterruptible sleep, which SIGKILL does not end (see above)."""

    def pids(self) -> dict[int, int]:
        return {**super().pids(), 7: 1}


def test_a_node_whose_rank_sigkill_cannot_end_leaves_the_job_with_one_line_and_its_rendezvous_open(
        agent_env: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Under nodes.py: rank 1 fails, its survivors are ended, one of them stays. The agent ends 1 with the line
    naming the host to drain (its last word for nodes.py, which carries on without the node under --nodes MIN:MAX),
    without closing the rendezvous the other nodes restart in (closing it would end them all)."""
    folder = agent_env
    os.environ["FAIL_RANK"] = "1"
    agent = make_agent(folder, WithAStuckRank, host="gpu-n7", under_nodes=True, stacks=False, stuck_s=0.5)
    closed: list[bool] = []
    agent.get_worker_group().spec.rdzv_handler.shutdown = lambda: closed.append(True) or True  # type: ignore
    assert agent_module.run(agent) == 1
    err = capfd.readouterr().err
    assert agent.last_word.startswith("error: host gpu-n7: rank pid 1 still there 0.5 s after SIGKILL"), err
    assert "drain host gpu-n7" in agent.last_word and agent.last_word.endswith(
        "resume with: ./launch.sh pretrain --config run.json")
    assert f"launch.sh: {agent.last_word}" in err.splitlines()
    assert not closed and not list(folder.glob("ready-*-1")), "the rendezvous was closed, or the node restarted"
