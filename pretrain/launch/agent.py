"""The ranks of `./launch.sh pretrain` on one node, under torch's elastic agent: restarts, hangs, one line each.

    python -m pretrain.launch.agent --nproc-per-node N [--master-addr A --master-port P | --rdzv-endpoint H:P]
        [--rdzv-key-file F --nnodes N|MIN:MAX --job MARK (--node HOST | --slurm)] [--resume-command TEXT]
        -- --config RUN.json [--section.key=value ...]

launch.sh runs this instead of a bare launcher: itself on one machine (where it also hosts the c10d rendezvous);
on several nodes nodes.py runs one per node (pdsh with --node, or the node's srun task with --slurm), all joining
the rendezvous store nodes.py serves (--rdzv-endpoint, signed with --rdzv-key-file's key). It reads the run config
(run.max_restarts, the two timeouts, run.dir) and hands the ranks (`python -m pretrain.train ARGS`) to torch's
`LocalElasticAgent`, which starts them, watches them, and restarts the whole group from the newest checkpoint when
one dies. What is ours on top (HealingAgent):

- every failure is judged once (pretrain/launch/faults.py) into a FaultRecord: one line (which rank and host, how
  it died, where, the checkpoint it restarts from, "restart k of N": k faults since that checkpoint, the budget
  being run.max_restarts between two checkpoints; when no restart is left, one error line with the command that
  resumes, and the job's exit status), kept in RUN/logs/faults/ for every node to read. A config
  error the ranks find is printed once, exit 2, never restarted. Under nodes.py the record goes to it as one JSON
  line instead, and nodes.py shows the most telling node's. The rank's stderr goes to
  RUN/logs/<launch>/attempt-K/rank-R.log; stdout stays on the terminal; torch's own log lines go to agent.log.
- hangs, at any moment of a rank's life: our timer server (pretrain/launch/hang_watch.py), started once here and
  handed to the ranks through TORCHELASTIC_TIMER_FILE, times each rank's start-up from the moment it is started,
  then its stages and steps (pretrain/distributed/step_watch.py). A rank that runs out is asked for its stacks,
  then killed; the agent lives on and restarts the group.
- a lost node: nodes.py sends NODE_LOST_SIGNAL to the survivors' agents; an agent whose ranks still run in a world
  that counted the lost node kills them at once (a collective with a dead peer would wait for its hang timer) and
  restarts without it.
- one verdict per job: a final verdict closes the rendezvous (as torchrun does when it exits), so no other node
  waits in it; an agent whose rendezvous another node closed ends quietly.
- signals: launch.sh passes SIGINT/SIGTERM/SIGUSR1/SIGHUP to this process, which passes them on to the ranks (they
  checkpoint at the step boundary and exit 0) and restarts nothing after. A rank that has no handler yet (its
  interpreter still starting) gets the signal once it has one; between two attempts (no rank running), or while a
  fault is handled, the stop is one line and exit 0 (130 for SIGINT): the checkpoint to resume from is `latest`.

torch internals this relies on, every other use being public API (get_worker_group, Worker.id, WorkerSpec,
LogsSpecs, RendezvousParameters, the rendezvous handler's shutdown, FileTimerServer/FileTimerRequest, the
variables torch gives each rank: LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE). tests/launch/test_torch_internals.py
checks each of these, in seconds and without ranks, and pyproject.toml bounds torch to the versions it passed on
(2.13.0 and 2.14.1):

1. `SimpleElasticAgent._remaining_restarts`, read and written: torch's run loop (`_invoke_run`) restarts while it is
   positive (from TORCH_ATTEMPTS: the budget is judged here, not by torch); a final verdict sets it to 0, and a
   restart torch does not count (another node's failure: the group is healthy and `num_nodes_waiting()` > 0) is
   counted here, so the attempt's number (its records, its attempt-K folder) is the same on every node.
2. `SimpleElasticAgent._monitor_workers`, overridden (torch's documented hook for extending the agent): each failure
   is judged where torch sees it; also where new ranks get their start-up timer and lost nodes are acted on.
3. `SimpleElasticAgent._restart_workers`, overridden: the count of (1) for a healthy group, whose ranks are ended
   as a fault's survivors first (survivors.py: stacks, SIGKILL; torch's `_stop_workers` would SIGTERM them with a
   30 s grace), and no restart after a stop.
4. `FileTimerServer._reap_worker`, overridden: torch's server calls it for each expired worker and then with its own
   pid; ours asks for stacks first, and skips the second call (torch would kill the agent).
5. `LocalElasticAgent._setup_local_watchdog`'s behaviour: with TORCHELASTIC_ENABLE_FILE_TIMER unset and
   TORCHELASTIC_TIMER_FILE set, it starts no server of its own and hands that path to the ranks.
6. The environment switch TORCH_DISABLE_SHARE_RDZV_TCP_STORE: each attempt's ranks get a store of their own.
7. TORCHELASTIC_SIGNALS_TO_HANDLE, read by torch's `PContext.start`: torch handles SIGQUIT alone, the agent forwards
   the rest (HealingAgent.forward).
8. TORCHELASTIC_RUN_ID, set by `_start_workers` for the ranks: pretrain/distributed/info.py tells a restart by it.
9. The rendezvous key `last_call_timeout` (run.last_call_seconds), read by the c10d handler's `create_handler`.
10. A node that leaves the job (pretrain/launch/agent_end.py leave) runs the dynamic handler's own exit operation
   (`_op_executor.run(_RendezvousExitOp(), _get_deadline(...))`, after `_stop_heartbeats`), as torch does before a
   node joins a new round, so the others need not wait for its heartbeats to lapse; failing, they lapse as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException

from pretrain.config.cli import parse_args
from pretrain.config.load import load_config
from pretrain.config.sections import RunConfig
from pretrain.errors import NODE_NAME_ENV, NODES_SPARE_ENV, UserError
from pretrain.launch.agent_end import run, say
from pretrain.launch.bad_nodes import HostFaults, Room
from pretrain.launch.faults import (
    RECORD_PREFIX,
    AgentEnd,
    FaultContext,
    FaultHistory,
    FaultRecord,
    RankFailure,
    judge,
    judge_stuck,
    primary_failure,
)
from pretrain.launch.hang_watch import HangWatch, Limits, watch_ranks
from pretrain.launch.joins import JoinNote
from pretrain.launch.nodes import NODE_LOST_SIGNAL, node_range
from pretrain.launch.processes import ended_badly, kill, pass_on, running
from pretrain.launch.rank_logs import RankLogs, nccl_trace, quiet_torch_logs
from pretrain.launch.signed_rendezvous import meeting_for, signed_handler
from pretrain.launch.survivors import NodeSettings, NodeUnhealthy, end_ranks
from pretrain.plugin import JobShare
from pretrain.plugin_registry import plugin_spec
from pretrain.run_folder import faults_dir, launch_logs_dir

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
PIPE_READ_S = 0.3  # the timer server reads the ranks' pipe every 0.1 s (pretrain/launch/hang_watch.py)
# torch's own count of restarts (WorkerSpec.max_restarts): never what stops the job. The budget is ours,
# run.max_restarts faults since the last checkpoint (pretrain/launch/faults.py judge); a final verdict sets
# _remaining_restarts to 0. torch's count still numbers the attempts (attempt-K folders, TORCHELASTIC_RESTART_COUNT).
TORCH_ATTEMPTS = 1_000_000


@dataclass(frozen=True)
class Judging:
    """What the agent judges failures with: the run config (whose plug-in may give a rank a folder of its own), the
    context every line needs, and the job's fault history."""

    config: RunConfig
    context: FaultContext
    history: FaultHistory

    def context_for(self, rank: int, world_size: int) -> FaultContext:
        """The context of `rank`'s failure: the checkpoint folder that rank resumes from (its job's, under a plug-in
        that gives each share of the world a subfolder: codistillation's group<g>/checkpoints)."""
        for name, section in self.config.plugins.items():
            subfolder = plugin_spec(name).job_subfolder
            folder = subfolder(section, rank, world_size) if subfolder else None
            if folder:
                share = JobShare(rank=rank, world_size=world_size, subfolder=folder).config_for(self.config)
                return dataclasses.replace(self.context, checkpoint_dir=share.checkpoint_dir)
        return self.context


class HealingAgent(LocalElasticAgent):
    """LocalElasticAgent whose failures are judged (faults.judge) and told in one line each (module docstring)."""

    def __init__(self, spec: WorkerSpec, logs: RankLogs, judging: Judging, watch: HangWatch,
                 node: NodeSettings) -> None:
        # torch's own check of a rank stuck in uninterruptible sleep (D state: a hung driver or file system, which no
        # signal ends) is off unless given a limit: the hang limit, so judge_stuck names it.
        super().__init__(spec, logs, shutdown_timeout=node.shutdown_timeout,
                         uninterruptible_state_timeout=watch.limits.hang_s)
        self.logs, self.judging, self.watch, self.node = logs, judging, watch, node
        self.record: FaultRecord | None = None  # the last fault judged here, and its verdict
        self.stop_signal: int | None = None
        self.nodes_lost = 0  # NODE_LOST_SIGNALs from nodes.py
        self.timed: set[int] = set()  # pids whose start-up is timed
        self.stopped_for_lost_node: set[int] = set()
        self.ended_by_agent: set[int] = set()  # pids killed here because another rank of their group failed
        self.last_word = ""  # the line this node ends the job with, for nodes.py (a stuck rank: survivors.py)
        self.leaves = ""  # why this node leaves the job for good, for nodes.py (a SLURM requeue leaves it out)

    # ------------------------------------------------------------------ what torch calls
    def _monitor_workers(self, worker_group: Any) -> RunResult:
        self._time_new_ranks()
        self._stop_if_a_node_was_lost()
        self._end_survivors_of_a_fault()  # before torch's poll, which would stop them with SIGTERM and a 30 s grace
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._judge(result)
        return result

    def _restart_workers(self, worker_group: Any) -> None:
        # torch restarts a healthy group without counting it when another node waits in the rendezvous: that
        # node's ranks failed (it counted it). A failed group was counted by torch before this call. Counted here
        # too, every node numbers the attempts alike (the records' `restart`, by which the nodes' lines are matched).
        # Its ranks lost a peer (or a node joins): ended as a fault's survivors (survivors.py), not by torch's SIGTERM
        # and 30 s grace. After a user's stop they are saving: no restart, they end by themselves.
        if worker_group.state == WorkerState.HEALTHY:
            if self.stop_signal is not None:
                return
            if self._remaining_restarts > 0:
                self._remaining_restarts -= 1  # the attempt's number: TORCH_ATTEMPTS - _remaining_restarts
            self._end_ranks([pid for pid in self.pids().values() if running(pid)], "torch's healthy-group restart")
        if self.stop_signal is not None:  # a stop that came while the fault was judged: ends as between attempts
            raise SignalException("while a fault was handled", signal.Signals(self.stop_signal))
        super()._restart_workers(worker_group)

    # ------------------------------------------------------------------ ours
    def pids(self) -> dict[int, int]:
        """Global rank -> pid of the running group (Worker.id is the pid under a local agent)."""
        return {worker.global_rank: worker.id for worker in self.get_worker_group().workers
                if isinstance(worker.id, int)}

    @property
    def leaving(self) -> bool:
        """This node leaves the job (its last verdict dropped it): its rendezvous stays open to the others."""
        return self.record is not None and self.record.drop

    @property
    def exit_status(self) -> int:
        if self.stop_signal is not None and self.record is None:  # a stop, even one during a fault: 0 (the batch
            return 130 if self.stop_signal == signal.SIGINT else 0  # file requeues), 130 for Ctrl-C
        return self.record.exit_status if self.record is not None else 1

    def _time_new_ranks(self) -> None:
        for rank, pid in self.pids().items():
            if pid not in self.timed:
                self.timed.add(pid)
                self.watch.arm(pid, rank)

    def _stop_if_a_node_was_lost(self) -> None:
        """Ranks in a world that counted a node since lost: killed now, so the group restarts without it."""
        group = self.get_worker_group()
        if not self.nodes_lost or group.state != WorkerState.HEALTHY:
            return
        if (group.group_world_size or 1) <= self.node.max_nodes - self.nodes_lost:
            return  # this round already went on without it
        for pid in self.pids().values():
            if pid not in self.stopped_for_lost_node:
                self.stopped_for_lost_node.add(pid)
                kill(pid, signal.SIGKILL)

    def _failures(self, result: RunResult) -> list[RankFailure]:
        time.sleep(PIPE_READ_S)  # what a rank announced just before it died is read by the timer server by then
        group = self.get_worker_group()
        attempt = group.spec.max_restarts - self._remaining_restarts

        def failure(rank: int, pid: int, exitcode: int, noticed: float | None = None) -> RankFailure:
            watch = self.watch
            return RankFailure(rank, self.node.host, exitcode, watch.step_of(pid), self.logs.path(attempt, rank),
                               watch.hung.get(pid), pid in self.stopped_for_lost_node, nccl_trace(rank),
                               pid in watch.stacks, noticed, pid in self.ended_by_agent,
                               watch.limits.of(watch.startup.get(pid, True))[0])

        failed = [failure(rank, found.pid, found.exitcode, found.timestamp) for rank, found in result.failures.items()]
        # A rank named by the timers (a frozen peer) may not be reaped yet: a failure too.
        return failed + [failure(rank, pid, -signal.SIGKILL) for rank, pid in self.pids().items()
                         if pid in self.watch.hung and rank not in result.failures]

    def _judge(self, result: RunResult) -> None:
        failures = self._failures(result)  # a stop, before or during the fault: no restart (run() says it)
        if self.stop_signal is not None and not (failures and all(each.ended_run for each in failures)):
            self._remaining_restarts, self.record = 0, None
            return
        group = self.get_worker_group()
        restarts_done = group.spec.max_restarts - self._remaining_restarts
        if failures:
            first = primary_failure(failures)
            world = group.workers[0].world_size if group.workers else 1
            room = Room(group.group_world_size or 1, self.node.min_nodes, self.node.max_nodes)
            context = dataclasses.replace(self.judging.context_for(first.rank, world), room=room)
            self.record = judge(first, restarts_done, context, self.judging.history)
        else:  # torch's own verdict: a rank stuck in uninterruptible sleep (D state); it restarts nothing
            self.record = judge_stuck(self.node.host, restarts_done, self.judging.context, self.judging.history)
        if self.node.under_nodes:
            print(f"{RECORD_PREFIX}{self.record.to_json()}", file=sys.stderr, flush=True)
        else:
            say(self.record.line)
        if not self.record.restarts or self.record.drop:  # a drop: this node leaves, the others restart
            self._remaining_restarts = 0

    def _end_survivors_of_a_fault(self) -> None:
        """Once a rank has ended badly (read from /proc before torch reaps it), the others still running are ended
        (survivors.end_ranks: stacks, SIGKILL, gone), before torch's poll would stop them with SIGTERM and a 30 s
        grace. After a user's stop too: a rank whose peer died cannot finish its checkpoint."""
        pids = self.pids()
        if not any(ended_badly(pid) for pid in pids.values()):
            return
        survivors = [pid for pid in pids.values()  # not those the timers are ending (hang_watch.hung)
                     if pid not in self.ended_by_agent | set(self.watch.hung) and running(pid)]
        self._end_ranks(survivors, "a rank of this node ended badly")

    def _end_ranks(self, pids: list[int], why: str) -> None:
        if not pids:
            return
        self.ended_by_agent.update(pids)
        try:
            end_ranks(pids, self.watch, self.node, why)
        except NodeUnhealthy:
            self._pcontext = None  # torch's close would wait for the stuck rank for ever (SIGKILL, then wait())
            raise

    def forward(self, signum: int, _frame: Any = None) -> None:
        """launch.sh's signal, passed on to every rank; nothing is restarted after it. The same stop may come twice (a
        hang-up to the whole group, then launch.sh's own SIGTERM): once the ranks have stopped for the first, the
        second changes nothing (raising here would turn their clean stop into status 143)."""
        told_before = self.stop_signal is not None
        self.stop_signal = self.stop_signal or signum
        pids = [pid for pid in self.pids().values() if Path(f"/proc/{pid}").exists()]
        if not pids and told_before:
            return
        if not pids:  # in a rendezvous: end it
            raise SignalException("between two attempts (no rank running)", signal.Signals(signum))
        pass_on(pids, signum)

    def node_lost(self, _signum: int, _frame: Any = None) -> None:
        """nodes.py's word that a node of the job is gone (NODE_LOST_SIGNAL); acted on at the next monitor tick."""
        self.nodes_lost += 1


def telling_rounds(handler: Any, low: int, high: int, tell: Callable[[int], None] = lambda nodes: None) -> Any:
    """`handler`, whose every round also tells the ranks it starts how many nodes the job may lose now
    (NODES_SPARE_ENV: the round's nodes less --nodes MIN, 0 without MIN:MAX), for a rank that would evict its slow
    host (pretrain/metrics/slow_ranks.py): torch starts the ranks after the round, with this process's environment.
    `tell(0)` before this agent waits for a round, `tell(nodes)` once one took it: under nodes.py, which names a
    node that never joins (pretrain/launch/joins.py)."""
    meet = handler.next_rendezvous

    def next_rendezvous() -> Any:
        tell(0)
        info = meet()
        os.environ[NODES_SPARE_ENV] = str(Room(int(info.world_size), low, high).spare)
        tell(int(info.world_size))
        return info

    os.environ[NODES_SPARE_ENV] = "0"
    handler.next_rendezvous = next_rendezvous
    return handler


def told_to_nodes(host: str, last_call_s: float) -> Callable[[int], None]:
    """An agent's JoinNote as one line on its stderr, which nodes.py reads."""
    return lambda nodes: print(JoinNote(host, nodes, last_call_s).to_line(), file=sys.stderr, flush=True)


def build_agent(args: argparse.Namespace, module_args: list[str]) -> HealingAgent:
    config = load_config(*parse_args(module_args))  # the ranks read it again; a UserError here is one line
    node = os.environ.get("SLURMD_NODENAME", "") if args.slurm else args.node  # a name only on 2+ nodes
    node_mark = f"-{node}" if node else ""  # the nodes of a multi-node job share the run folder
    launch_dir = launch_logs_dir(Path(config.run.dir), time.strftime("%Y%m%d-%H%M%S") + node_mark)
    quiet_torch_logs(launch_dir / "agent.log")
    watch = watch_ranks(Limits(config.run.hang_timeout_minutes * 60, config.run.startup_timeout_minutes * 60),
                        launch_dir)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"  # the others: forwarded by HealingAgent.forward
    # a store of the ranks' own on a fresh port at each attempt: torch's shared agent store would keep the previous
    # attempt's keys (a restarted gloo mesh then dials the dead ranks' ports).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    low, high = node_range(args.nnodes) or (1, 1)
    job = args.job or f"bert-{uuid.uuid4().hex[:12]}"
    # Several nodes: the store is nodes.py's, every agent a client of it; one machine: this agent serves it, bound to
    # --master-addr. Every state is signed (signed_rendezvous.py). Under SLURM the ranks' store is on the fqdn.
    local_addr = None if args.slurm else args.node or args.master_addr
    meeting = meeting_for(args.rdzv_endpoint, (args.master_addr, args.master_port), args.rdzv_key_file)
    parameters = meeting.parameters(job, (low, high), local_addr, config.run.last_call_seconds)
    # SLURM gave the node's task all its ranks' CPUs: each rank takes its own share (pretrain/launch/pin.py), as
    # SLURM's per-task binding did when every rank was a task.
    rank = ("-u", "-m", "pretrain.train", *module_args)
    host = node or socket.gethostname()
    os.environ[NODE_NAME_ENV] = host  # the ranks name their node as the lines do (a slow rank's `evicting host`)
    tell = told_to_nodes(host, config.run.last_call_seconds) if args.rdzv_endpoint else (lambda nodes: None)
    spec = WorkerSpec(role="rank", local_world_size=args.nproc_per_node, entrypoint=sys.executable,
                      args=("-u", "-m", "pretrain.launch.pin", "--", *rank) if args.slurm else rank,
                      rdzv_handler=telling_rounds(signed_handler(parameters, meeting), low, high, tell),
                      max_restarts=TORCH_ATTEMPTS, monitor_interval=0.2, local_addr=local_addr)
    logging.getLogger("torch.distributed.elastic").info("ranks run: %r", [sys.executable, *spec.args])
    run_dir = Path(config.run.dir)
    context = FaultContext(job, config.run.max_restarts, run_dir, config.checkpoint_dir, args.resume_command,
                           host_faults=HostFaults(config.run.host_fault_limit, config.run.host_fault_hours))
    judging = Judging(config, context, FaultHistory(faults_dir(run_dir)))
    settings = NodeSettings(host, low, high, bool(args.rdzv_endpoint),
                            int(float(os.environ.get("BERT_DS_KILL_GRACE_SECONDS", "30"))), config.run.survivor_stacks)
    return HealingAgent(spec, RankLogs(launch_dir), judging, watch, settings)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    module_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1", help="one machine: where this agent hosts the rendezvous")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--rdzv-endpoint", default="", help="multi-node jobs: the rendezvous store nodes.py serves")
    parser.add_argument("--rdzv-key-file", default="", help="with --rdzv-endpoint: the job's rendezvous key (nodes.py)")
    parser.add_argument("--resume-command", default="the same command again")
    parser.add_argument("--nnodes", default="", help="multi-node jobs: N or MIN:MAX nodes (pretrain/launch/nodes.py)")
    parser.add_argument("--node", default="", help="hostfile jobs: this node's name in the hostfile")
    parser.add_argument("--job", default="", help="multi-node jobs: the launch's mark (rendezvous id, signals)")
    parser.add_argument("--slurm", action="store_true",
                        help="one task of a SLURM step (pretrain/launch/transports.py): node name from SLURMD_NODENAME,"
                             " each rank pinned to its share of the task's CPUs")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        agent = build_agent(args, module_args)
    except Exception as err:  # noqa: BLE001 - one line, and under nodes.py this node's last word, whatever it was
        status, line = (2, err.line()) if isinstance(err, UserError) else (
            1, f"error: the agent could not start: {type(err).__name__}: {err}")
        say(line)
        if args.rdzv_endpoint:  # nodes.py: this node ended before it joined; the others need not wait for it
            host = os.environ.get("SLURMD_NODENAME", "") if args.slurm else args.node
            print(AgentEnd(host or socket.gethostname(), status, line).to_line(), file=sys.stderr, flush=True)
        return status
    for signum in FORWARDED:
        signal.signal(signum, agent.forward)
    signal.signal(NODE_LOST_SIGNAL, agent.node_lost)
    status = run(agent)
    if agent.node.under_nodes:  # nodes.py: this node ended by itself, whatever its transport says next
        print(AgentEnd(agent.node.host, status, agent.last_word, agent.leaves).to_line(), file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
