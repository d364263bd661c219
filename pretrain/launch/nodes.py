"""`./launch.sh pretrain --hostfile`: our elastic agent on every node through pdsh + ssh, and lost nodes told.

    python -m pretrain.launch.nodes --hostfile F [--nodes N|MIN:MAX] --nproc-per-node N --master-addr A
        --master-port P [--env-file F] [--resume-command TEXT] -- ARGS (quoted for the remote shell)

pdsh runs, on every host at once, `cd CHECKOUT; export ...; PYTHON -u -m pretrain.launch.agent --node %h ...`
(pdsh puts each host's name for %h). The agents meet in torch's c10d rendezvous on A:P (the first host
serves it) and each starts its node's ranks; a failure anywhere restarts every node's ranks from the newest
checkpoint (pretrain/launch/agent.py). This process relays what the nodes print and watches pdsh for a node
that is gone: its ssh session ends while its agent had not ended by itself (status >= 128: the agent or its
machine was killed, or ssh lost the connection). Then:

- with `--nodes MIN:MAX` and at least MIN nodes left: one line, and the job carries on without it; the
  survivors' ranks fail at their next collective, their agents meet again in a smaller world, and the run
  resumes from the newest checkpoint on fewer ranks (exact across world sizes: the global batch is the
  config's, the accumulation is derived);
- otherwise: one error line naming the node, and the other nodes are stopped at once (their ranks would
  otherwise wait in the rendezvous, or in a collective until run.dist_timeout_minutes).

Signals (launch.sh passes them here) reach every node's agent through `pdsh ... pkill -SIG -f JOB`, JOB being
this launch's own mark on the agents' command lines; the agents pass them on to their ranks.

Standard library only: launch/plan.py reads `node_range` from here with a bare python3.
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
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pretrain.launch.cluster import ClusterError, pdsh_quote, read_hostfile

PREFIX = "launch.sh"
LOST_STATUS = 128  # an agent ends by itself with 0-3 (pretrain/launch/agent.py); >= 128: it was killed
_SSH_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh (?:exited with exit code (\d+)|killed by signal (\d+))")
_RANGE = re.compile(r"([0-9]+)(?::([0-9]+))?", re.ASCII)


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


def remote_word(arg: str) -> str:
    """One word of the remote command, already pdsh-quoted (pretrain/launch/cluster.py's pdsh_quote): wrapped in
    "..." when it holds a space, as DeepSpeed's pdsh runner did, which pdsh_quote was written for."""
    return '"{}"'.format(arg.replace('"', '\\"')) if " " in arg else arg


@dataclass
class NodeJob:
    """One hostfile launch: the hosts, how many may be lost, and the agents' command line."""

    hosts: list[str]
    min_nodes: int
    agent_args: list[str]  # what every agent gets, before its --node
    module_args: list[str]  # the driver's arguments, pdsh-quoted
    exports: list[str] = field(default_factory=list)  # NAME=VALUE lines for every node
    resume_command: str = ""
    mark: str = field(default_factory=lambda: f"bert-job-{uuid.uuid4().hex[:12]}")
    lost: list[str] = field(default_factory=list)
    ended: dict[str, int] = field(default_factory=dict)  # host -> its session's status, when not 0
    stopping: bool = False  # a signal to pass on, or a lost node the job cannot do without
    failed: bool = False  # the latter

    def remote_command(self) -> list[str]:
        exports = "".join(f"export {line.partition('=')[0]}={pdsh_quote(line.partition('=')[2])}; "
                          for line in self.exports)
        agent = ["-u", "-m", "pretrain.launch.agent", *self.agent_args, "--job", self.mark, "--node", "%h",
                 "--resume-command", pdsh_quote(self.resume_command), "--", *self.module_args]
        return [exports + f"cd {pdsh_quote(os.getcwd())};", pdsh_quote(sys.executable),
                *(remote_word(word) for word in agent)]

    def pdsh(self, hosts: Sequence[str], command: Sequence[str]) -> list[str]:
        return ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), *command]

    def signal_agents(self, signum: int, hosts: Sequence[str] | None = None) -> None:
        """`signum` to the agents of this job on `hosts` (all), which pass it on to their ranks."""
        targets = [host for host in (hosts or self.hosts) if host not in self.lost]
        if targets:
            # the agents alone: pdsh, ssh and the remote shell also carry the mark in their command lines
            agents = shlex.quote(f"^[^ ]*python[^ ]* -u -m pretrain[.]launch[.]agent .*--job {self.mark} ")
            subprocess.run(self.pdsh(targets, ["pkill", f"-{signal.Signals(signum).name[3:]}", "-f", agents]),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=pdsh_env(), check=False)

    def node_ended(self, host: str, status: int) -> list[str]:
        """pdsh's word that `host`'s session ended with `status`: a lost node when the agent did not end it.
        Returns the hosts whose agents must stop now (the job cannot do without the lost node)."""
        self.ended[host] = status
        if status < LOST_STATUS or self.stopping or host in self.lost:
            return []
        self.lost.append(host)
        left = len(self.hosts) - len(self.lost)
        why = f"node {host} lost (its session ended with status {status}: the machine, its agent or ssh died)"
        if left >= self.min_nodes and self.min_nodes < len(self.hosts):
            say(f"fault: {why}; carrying on with {left} node(s) (--nodes {self.min_nodes}:{len(self.hosts)})")
            return []
        self.stopping = self.failed = True
        say(f"error: {why}; stopping the other node(s) (--nodes MIN:MAX carries on without a lost node); "
            f"resume with: {self.resume_command}")
        return [other for other in self.hosts if other not in self.lost]


def say(line: str) -> None:
    print(f"{PREFIX}: {line}", file=sys.stderr, flush=True)


def pdsh_env() -> dict[str, str]:
    return {**os.environ, "PDSH_RCMD_TYPE": "ssh"}


def relay(stream: IO[str], out: IO[str], job: NodeJob) -> None:
    """The nodes' lines as they come; pdsh's own 'ssh exited' lines become ours (node_ended)."""
    for line in stream:
        ended = _SSH_EXIT.match(line)
        if ended:  # the session's status, or the shell's 128 + signal when pdsh's ssh itself was killed
            to_stop = job.node_ended(ended[1], int(ended[2]) if ended[2] else 128 + int(ended[3]))
            if to_stop:
                job.signal_agents(signal.SIGTERM, to_stop)
            continue
        out.write(line)
        out.flush()


def run(job: NodeJob) -> int:
    proc = subprocess.Popen(job.pdsh(job.hosts, job.remote_command()), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=pdsh_env())

    def forward(signum: int, _frame: object) -> None:
        job.stopping = True
        threading.Thread(target=job.signal_agents, args=(signum,), daemon=True).start()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(signum, forward)
    threads = [threading.Thread(target=relay, args=(proc.stdout, sys.stdout, job), daemon=True),
               threading.Thread(target=relay, args=(proc.stderr, sys.stderr, job), daemon=True)]
    for thread in threads:
        thread.start()
    status = proc.wait()
    for thread in threads:
        thread.join(timeout=5)
    if job.failed:
        return 1
    if job.lost:  # carried on without them: the job's status is the survivors'
        return max([code for host, code in job.ended.items() if host not in job.lost], default=0)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.nodes", description=__doc__.split("\n")[0])
    parser.add_argument("--hostfile", required=True, help='lines "HOST slots=N" (pretrain/launch/cluster.py)')
    parser.add_argument("--nodes", default="", help="N or MIN:MAX (default: every host, none may be lost)")
    parser.add_argument("--nproc-per-node", required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", required=True)
    parser.add_argument("--env-file", help="NAME=VALUE lines exported on every node")
    parser.add_argument("--resume-command", default="the same command again")
    parser.add_argument("--args-quoted", action="store_true",
                        help="the driver's arguments are already pdsh-quoted (pretrain/launch/cluster.py, 2+ nodes)")
    args = parser.parse_args(argv[:split])
    hosts = [host for host, _ in read_hostfile(args.hostfile)]
    low, high = node_range(args.nodes) or (len(hosts), len(hosts))
    exports = Path(args.env_file).read_text(encoding="utf-8").splitlines() if args.env_file else []
    agent_args = ["--nproc-per-node", args.nproc_per_node, "--nnodes", f"{low}:{high}",
                  "--master-addr", args.master_addr, "--master-port", args.master_port]
    module_args = argv[split + 1:] if args.args_quoted else [pdsh_quote(arg) for arg in argv[split + 1:]]
    job = NodeJob(hosts[:high], low, agent_args, module_args, [line for line in exports if "=" in line],
                  args.resume_command)
    return run(job)


if __name__ == "__main__":
    sys.exit(main())
