"""`./launch.sh pretrain` on several nodes: our elastic agent on every node, their rendezvous store, lost nodes told.

    python -m pretrain.launch.nodes (--hostfile F | --slurm) [--nodes N|MIN:MAX] --nproc-per-node N
        --rdzv-endpoint HOST:PORT [--env-file F] [--cpus-per-task C] [--gpus] [--resume-command TEXT] -- ARGS

With a hostfile pdsh + ssh start the agents, inside a SLURM allocation srun does (one task per node);
pretrain/launch/transports.py has both. The agents meet in torch's c10d rendezvous, whose store this process serves
on this machine (pretrain/launch/store.py; pretrain/launch/rendezvous.py says why: no node is a single point of
failure), unless --rdzv-endpoint names a store served elsewhere. Each agent starts its node's ranks; a failure
anywhere restarts every node's ranks from the newest checkpoint (pretrain/launch/agent.py). This process relays
what the nodes print and watches for a node that is gone: its session ends while its agent had not ended by itself
(the agent's own last word, AgentEnd, did not come; the status is >= 128: the agent or its machine was killed, ssh
lost the connection, SLURM declared the node failed or its task out of memory). Then:

- with `--nodes MIN:MAX` and at least MIN nodes left: one line, and the job carries on without it: the survivors'
  agents get NODE_LOST_SIGNAL, kill their ranks at once and meet again in a smaller world (the run resumes from
  the newest checkpoint on fewer ranks: the global batch is the config's, the accumulation is derived);
- otherwise: one error line naming the node, and the other nodes are stopped at once.

A node that ends by itself with a non-zero status while no node has reached a final verdict (its agent could not
start) is a node fault as well, its last line quoted. A node whose agent never joins the rendezvous is named
(joins.py). A bad or slow node leaves the job under --nodes MIN:MAX (bad_nodes.py: its agent's record says `drop`):
its agent ends, and is ended through the transport too (pkill over pdsh, an overlapping srun step on that node); the
survivors are told as for a lost node; under SLURM its requeue starts no agent there (excluded_hosts.py).
The agents' fault records (FaultRecord, one JSON line each) become one line per fault: the most telling node's
(FaultLines). The store's death ends the job with one line. Signals (launch.sh passes them here) reach every node's
agent through the transport (pkill of this launch's mark, or scancel of the agents' step), and on to the ranks.

Standard library only: pretrain/launch/plan.py reads `node_range` from here with a bare python3.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from pretrain.distributed.cluster import ClusterError, pdsh_quote, read_hostfile
from pretrain.launch.excluded_hosts import exclude, excluded, run_dir_of, slurm_hosts
from pretrain.launch.fault_records import AgentEnd, FaultLines, FaultRecord
from pretrain.launch.joins import JoinNote, JoinWatch, watch_joins
from pretrain.launch.node_env import read_env_file
from pretrain.launch.processes import wait_bounded
from pretrain.launch.rendezvous import parse_endpoint
from pretrain.launch.rendezvous_key import handed_to
from pretrain.launch.store_reach import check_before_start, serve_store
from pretrain.launch.transports import Pdsh, SessionEnd, Srun

PREFIX = "launch.sh"
LOST_STATUS = 128  # an agent ends by itself with 0-4 (pretrain/launch/agent.py); >= 128: it was killed
# To the survivors' agents: a node is lost, restart without it. Ignored by default: under SLURM (scancel signals a
# whole step) it reaches the ranks too, which must not end on it.
NODE_LOST_SIGNAL = signal.SIGURG
_RANGE = re.compile(r"([0-9]+)(?::([0-9]+))?", re.ASCII)
AGENTS_ENDED_GRACE_S = 60.0  # how long the transport may outlive the last agent's end (its sessions closing)
DROP_GRACE_S = 10.0  # how long a dropped node's agent has to end by itself before the transport ends it


class NodeRangeError(ClusterError):
    """--nodes is neither N nor MIN:MAX with 0 < MIN <= MAX."""


def node_range(value: str) -> tuple[int, int] | None:
    """--nodes N (exactly N nodes) or MIN:MAX (carry on while at least MIN are left); None when not given."""
    if not value:
        return None
    match = _RANGE.fullmatch(value)
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 0 < low <= high:
        raise NodeRangeError(f"--nodes must be a positive integer, got '{value}'" if ":" not in value else
                             f"--nodes MIN:MAX needs 0 < MIN <= MAX, got '{value}'")
    return low, high


class Transport(Protocol):
    """What starts the agents (pretrain/launch/transports.py)."""

    def command(self, hosts: Sequence[str], agent_args: Sequence[str], module_args: Sequence[str],
                resume_command: str) -> list[str]: ...

    def env(self) -> dict[str, str]: ...

    def session_end(self, line: str) -> SessionEnd | None: ...

    def quiet(self, line: str) -> bool: ...

    def signal(self, signum: int, hosts: Sequence[str]) -> None: ...

    def drop(self, host: str) -> bool: ...

    def store_problem(self, host: str, store: tuple[str, int]) -> str | None: ...

    def shipped(self) -> AbstractContextManager[None]: ...  # node_env delivered while the agents run


@dataclass
class NodeJob:
    """One launch over several nodes: the hosts, how many may be lost, the agents' command line, the rendezvous."""

    hosts: list[str]
    min_nodes: int
    transport: Transport
    agent_args: list[str]  # what every agent gets (its --node or --slurm comes from the transport)
    module_args: list[str]  # the driver's arguments, as the transport wants them
    resume_command: str = ""
    rendezvous: str = ""  # HOST:PORT of the store; served here when HOST is this machine
    lost: list[str] = field(default_factory=list)
    ended: dict[str, int] = field(default_factory=dict)  # host -> its session's status, when not 0
    agents_ended: dict[str, int] = field(default_factory=dict)  # host -> the status its agent said it ends with
    stopping: bool = False  # a signal to pass on, or a lost node the job cannot do without
    failed: bool = False  # the latter
    run_dir: Path | None = None  # where a SLURM job keeps the hosts it dropped (excluded_hosts.py)
    slurm_job: str = ""  # the SLURM job id: its requeue leaves them out; empty with a hostfile
    verdict: bool = False  # a node's agent reached a final verdict: the others end because of it
    last_lines: dict[str, str] = field(default_factory=dict)  # host -> the last line it printed (pdsh names it)
    leaving: dict[str, str] = field(default_factory=dict)  # host -> why its agent said its node leaves for good
    joins: JoinWatch = field(default_factory=JoinWatch)  # who joined the rendezvous (joins.py)

    @property
    def nodes_left(self) -> int:
        return len(self.hosts) - len(self.lost)

    def command(self) -> list[str]:
        return self.transport.command(self.hosts, self.agent_args, self.module_args, self.resume_command)

    def signal_agents(self, signum: int, hosts: Sequence[str] | None = None) -> None:
        """`signum` to the agents of this job on `hosts` (all), which pass it on to their ranks."""
        targets = [host for host in (hosts or self.hosts) if host not in self.lost]
        if targets:
            self.transport.signal(signum, targets)

    def node_ended(self, end: SessionEnd, first: Callable[[], None] = lambda: None) -> tuple[int, list[str]] | None:
        """The word that `end.host`'s session ended: a lost node when its agent did not end by itself; a node fault
        too when it ended by itself with a non-zero status before the job's end (no node's final verdict, no stop:
        an agent that could not start, a node without the mount or the venv), which would otherwise leave the
        others waiting in the rendezvous. Returns what to send to whom: NODE_LOST_SIGNAL to the survivors when the
        job carries on, SIGTERM to the others when it cannot. `first` runs before a line is printed (the fault
        lines still held go out before it)."""
        host = end.host
        status = self.ended[host] = self.agents_ended.get(host, end.status)
        if self.stopping or host in self.lost or self.verdict:
            return None
        if self.leaving.get(host):  # for good (a rank SIGKILL cannot end): its requeue starts no agent there
            exclude(self.run_dir, self.slurm_job, host, self.leaving[host])
        if end.status >= LOST_STATUS and host not in self.agents_ended:
            how = end.why or "the machine, its agent or its link died"
            why = f"node {host} lost (its session ended with status {end.status}: {how})"
        elif status != 0:  # ended by itself, no verdict told: it failed on its own (a missing mount, venv, checkout)
            said = self.last_lines.get(host)
            why = (f"node {host} ended by itself with status {status} before the job's end"
                   + (f" ({said})" if said else ""))
        else:
            return None
        self.lost.append(host)
        first()
        left = [other for other in self.hosts if other not in self.lost]
        if len(left) >= self.min_nodes and self.min_nodes < len(self.hosts):
            say(f"fault: {why}; carrying on with {len(left)} node(s) (--nodes {self.min_nodes}:{len(self.hosts)})")
            return NODE_LOST_SIGNAL, left
        self.stopping = self.failed = True
        say(f"error: {why}; stopping the other node(s) (--nodes MIN:MAX carries on without a lost node); "
            f"resume with: {self.resume_command}")
        return signal.SIGTERM, left

    def node_dropped(self, record: FaultRecord, first: Callable[[], None] = lambda: None
                     ) -> tuple[int, list[str]] | None:
        """A node whose agent judged that it leaves the job (record.drop, bad_nodes.py; its record's line says why):
        lost to the job, its agent ended through the transport too unless it ends by itself, the survivors told as
        for a lost node, kept out of a SLURM requeue. A second at once with no room for it stops the job."""
        host = record.host
        if not record.drop or host in self.lost or self.stopping:
            return None
        self.lost.append(host)
        threading.Thread(target=self.end_agent, args=(host, DROP_GRACE_S), daemon=True).start()
        exclude(self.run_dir, self.slurm_job, host, record.line)
        first()
        left = [other for other in self.hosts if other not in self.lost]
        if len(left) >= self.min_nodes:
            return NODE_LOST_SIGNAL, left
        self.stopping = self.failed = True
        say(f"error: node {host} left the job and {len(left)} node(s) are left, fewer than --nodes "
            f"{self.min_nodes}:{len(self.hosts)} needs; stopping them; resume with: {self.resume_command}")
        return signal.SIGTERM, left

    def end_agent(self, host: str, grace_s: float) -> None:
        """`host`'s agent ended through the transport unless it ends by itself within `grace_s` (its own way out
        leaves the rendezvous at once; a kill lets its heartbeats lapse)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and host not in self.agents_ended and host not in self.ended:
            time.sleep(0.2)
        if host not in self.agents_ended and host not in self.ended:
            self.transport.drop(host)

    def not_joined(self, hosts: list[str], nodes: int) -> None:
        """`hosts` have not joined the rendezvous (joins.py): left behind by a round of `nodes` under --nodes MIN:MAX
        (one line), or, the job needing them (`nodes` 0), named and stopped with the others."""
        if self.stopping:
            return
        named = ", ".join(hosts)
        if nodes:
            say(f"warning: node(s) {named} had not joined the rendezvous when its last call ended: the job goes on "
                f"with {nodes} node(s) (--nodes {self.min_nodes}:{len(self.hosts)}); they join at its next round")
            return
        self.stopping = self.failed = True
        say(f"error: node(s) {named} have not joined the rendezvous {self.joins.grace_s:g} s after the others began "
            f"to wait (an agent stuck before it joins: a stale mount, a cold file system); stopping every node; "
            f"resume with: {self.resume_command}")
        for host in hosts:
            threading.Thread(target=self.transport.drop, args=(host,), daemon=True).start()
        self.signal_agents(signal.SIGTERM, [host for host in self.hosts if host not in hosts])

    def store_ended(self, status: int) -> None:
        """The rendezvous store this process served is gone while the nodes run: they could not meet again."""
        if self.stopping:
            return
        self.stopping = self.failed = True
        say(f"error: the rendezvous store of this job ({self.rendezvous}, on this machine) ended with status {status}; "
            f"the nodes cannot meet again: stopping them; resume with: {self.resume_command}")
        self.signal_agents(signal.SIGTERM)


def say(line: str) -> None:
    print(f"{PREFIX}: {line}", file=sys.stderr, flush=True)


def relay(stream: IO[str], out: IO[str], job: NodeJob, faults: FaultLines) -> None:
    """The nodes' lines as they come; the transport's own 'session ended' lines become ours (node_ended), an agent's
    last word is noted, and the nodes' records of one failure become one line (FaultLines)."""
    for line in stream:
        ended = job.transport.session_end(line)
        if ended:
            act = job.node_ended(ended, faults.show_all)  # the lines stay in the order of what happened
            if act:
                job.signal_agents(*act)
            continue
        joining = JoinNote.from_line(line)
        if joining:
            job.joins.note(joining, time.monotonic())
            continue
        agent = AgentEnd.from_line(line)
        if agent:
            job.agents_ended[agent.host] = agent.status
            if agent.line:
                job.last_lines[agent.host] = agent.line
            if agent.leaves:
                job.leaving[agent.host] = agent.leaves
            continue
        record = FaultRecord.from_line(line)
        if record is not None:
            job.verdict = job.verdict or not record.restarts
            faults.offer(line)
            act = job.node_dropped(record, faults.show_all)
            if act:
                job.signal_agents(*act)
        elif not job.transport.quiet(line):
            host, _, said = line.partition(": ")
            if host in job.hosts and said.strip():
                job.last_lines[host] = said.strip()
            out.write(line)
            out.flush()


def watch_store(store: subprocess.Popen[bytes], nodes: subprocess.Popen[str], job: NodeJob) -> None:
    status = store.wait()
    if nodes.poll() is None:  # not our own stop at the job's end
        job.store_ended(status)


def run(job: NodeJob) -> int:
    store = None
    with ExitStack() as shipping:
        try:
            store = serve_store(job)
            job.hosts = check_before_start(job, store is not None, say)
            shipping.enter_context(job.transport.shipped())  # the nodes' variables, removed when the job ends
        except ClusterError as err:
            say(f"error: {err}")
            if store is not None:
                store.terminate()
                store.wait()
            return 2
        return run_agents(job, store)


def run_agents(job: NodeJob, store: subprocess.Popen[bytes] | None) -> int:
    proc = subprocess.Popen(job.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, env=job.transport.env())

    def forward(signum: int, _frame: object) -> None:
        job.stopping = True
        threading.Thread(target=job.signal_agents, args=(signum,), daemon=True).start()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(signum, forward)
    faults = FaultLines(sys.stderr, lambda: job.nodes_left)
    threads = [threading.Thread(target=relay, args=(proc.stdout, sys.stdout, job, faults), daemon=True),
               threading.Thread(target=relay, args=(proc.stderr, sys.stderr, job, faults), daemon=True)]
    if store is not None:  # noticed at once: a thread waits on it
        threads.append(threading.Thread(target=watch_store, args=(store, proc, job), daemon=True))
    ended = threading.Event()
    running = lambda: [host for host in job.hosts if host not in job.lost and host not in job.agents_ended]  # noqa: E731
    threads.append(threading.Thread(target=watch_joins, daemon=True, args=(
        job.joins, running, job.min_nodes == len(job.hosts), job.not_joined, ended)))
    for thread in threads:
        thread.start()
    # every node's agent has said it ended: pdsh ends with their sessions, unless a rank left behind (in D state)
    # holds its channel open; then it is ended after AGENTS_ENDED_GRACE_S, the status being the agents' own
    status = wait_bounded(proc, lambda: set(job.hosts) <= set(job.agents_ended) | set(job.lost), AGENTS_ENDED_GRACE_S)
    if status is None:
        say(f"warning: every node's agent has ended, but the sessions to the nodes (pdsh, srun) were still open "
            f"{AGENTS_ENDED_GRACE_S:g} s later (a rank left behind holds its channel): ended them")
        status = max(job.agents_ended.values(), default=1)
    ended.set()
    for thread in threads[:2]:
        thread.join(timeout=5)
    if store is not None:
        store.terminate()
        store.wait()
    faults.show_all()
    if job.failed:
        return 1
    if job.lost:  # carried on without them: the job's status is the survivors'
        return max([code for host, code in job.ended.items() if host not in job.lost], default=0)
    return status


def build_job(args: argparse.Namespace, module_args: list[str]) -> NodeJob:
    """The hosts and the transport: the hostfile's through pdsh, or the allocation's through srun."""
    mark = f"bert-job-{uuid.uuid4().hex[:12]}"
    run_dir, slurm_job = None, ""
    if args.hostfile:
        hosts = [host for host, _ in read_hostfile(args.hostfile)]
        low, high = node_range(args.nodes) or (len(hosts), len(hosts))
        transport: Transport = Pdsh(mark, read_env_file(args.env_file) if args.env_file else {}, args.python)
        if not args.args_quoted:
            module_args = [pdsh_quote(arg) for arg in module_args]
    else:
        low, high = node_range(args.nodes) or (1, 1)
        slurm_job, run_dir = os.environ.get("SLURM_JOB_ID", ""), run_dir_of(module_args)
        left_out = excluded(run_dir, slurm_job)
        hosts, note = slurm_hosts(high, low, left_out)
        if note:
            say(note)
        transport = Srun(mark, slurm_job, int(args.nproc_per_node),
                         int(args.cpus_per_task) if args.cpus_per_task else None, args.gpus, low < high, args.python,
                         sorted(left_out))
    parse_endpoint(args.rdzv_endpoint)  # one line for a malformed value
    agent_args = ["--nproc-per-node", args.nproc_per_node, "--nnodes", f"{low}:{high}",
                  "--rdzv-endpoint", args.rdzv_endpoint]
    return NodeJob(hosts[:high], low, transport, agent_args, module_args, args.resume_command, args.rdzv_endpoint,
                   run_dir=run_dir, slurm_job=slurm_job)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.nodes", description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--hostfile", help='lines "HOST slots=N" (pretrain/distributed/cluster.py): agents over pdsh + ssh')
    where.add_argument("--slurm", action="store_true", help="the nodes of this SLURM allocation: agents through srun")
    parser.add_argument("--nodes", default="", help="N or MIN:MAX (default: every host, none may be lost)")
    parser.add_argument("--nproc-per-node", required=True)
    parser.add_argument("--rdzv-endpoint", required=True,
                        help="HOST:PORT of the agents' rendezvous store: served here when HOST is this machine")
    parser.add_argument("--env-file", help="hostfile: NAME=VALUE lines for every node (shipped in a 0600 file, not argv)")
    parser.add_argument("--cpus-per-task", default="", help="SLURM: the job's CPUs per rank")
    parser.add_argument("--gpus", action="store_true", help="SLURM: the ranks use GPUs (the task asks for them)")
    parser.add_argument("--resume-command", default="the same command again")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the agents (default: this one)")
    parser.add_argument("--show", action="store_true", help="print the command that starts the agents, and exit")
    parser.add_argument("--args-quoted", action="store_true",
                        help="hostfile: the driver's arguments are already pdsh-quoted (pretrain/distributed/cluster.py)")
    args = parser.parse_args(argv[:split])
    try:
        job = build_job(args, argv[split + 1:])
    except ClusterError as err:
        say(f"error: {err}")
        return 2
    if args.show:
        print(shlex.join(job.command()))
        return 0
    with handed_to(job.agent_args):  # the job's rendezvous key, a 0600 file the agents read (not on argv)
        return run(job)


if __name__ == "__main__":
    sys.exit(main())
