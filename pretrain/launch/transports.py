"""How one launch's node agents are started, told apart when their session ends, and signalled: pdsh or srun.

pretrain/launch/nodes.py runs `python -m pretrain.launch.agent` once per node and watches for a node that is
gone. It needs three things from whatever starts the agents, and these two classes are the two ways:

- Pdsh (`--hostfile`): pdsh + ssh run `cd WORKDIR; <source the env file>; PYTHON -u -m pretrain.launch.agent --node
  %h ...` on every host at once; a session's end is pdsh's `ssh exited with exit code N` line; a signal reaches the
  agents through `pdsh ... pkill -SIG -f MARK`. The variables of `node_env` reach the nodes in a 0600 file on the
  shared working folder (pretrain/launch/node_env.py), never on pdsh's command line, which every user can read.
- Srun (inside a SLURM allocation): one job step of one task per node, each task an agent
  (`--slurm`: its name from SLURMD_NODENAME, its ranks pinned to their share of the task's CPUs); a task's end
  is srun's `srun: error: NODE: task K: Killed` / `Exited with exit code N` line; a signal reaches the agents
  (and their ranks) through `scancel --signal=SIG JOB.STEP`. Not srun's own forwarding: a SIGTERM to srun
  makes it abort the step (SIGKILL to every task, no checkpoint). One node's agent alone (a node that leaves the
  job) is ended by an overlapping step of one task on that node (`srun --overlap --nodelist=NODE`); a requeue of
  the job leaves out the nodes it dropped before (`--exclude`).

Why agents per node under SLURM rather than one srun task per rank: torch's agent restarts the ranks
inside the allocation with no requeue (seconds instead of a place in the queue), serves the hang timers and
meets the other nodes in a rendezvous that can go on without a lost one (`--nodes MIN:MAX`).

Standard library only, as nodes.py.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pretrain.distributed.cluster import pdsh_quote, remote_quote
from pretrain.launch.node_env import NOT_SHARED_STATUS, EnvFile, source_command

_PDSH_END = re.compile(r"^pdsh@\S+: (\S+): ssh (?:exited with exit code (\d+)|killed by signal (\d+))")
_SRUN_END = re.compile(r"^srun: error: (\S+): tasks? [0-9,-]+: (.+?)\s*$")
_SRUN_NODE_FAIL = re.compile(r"^srun: error: Node failure on (\S+)")
SRUN_OOM = "Out Of Memory"
_STEP_CANCELLED = re.compile(r"^slurmstepd\S*: error: \*\*\* STEP \S+ ON \S+ CANCELLED AT ")
_SIGNAL_WORDS = {signal.strsignal(number): number for number in signal.Signals if signal.strsignal(number)}
SSH_KEEP_ALIVE = "-o ServerAliveInterval=15 -o ServerAliveCountMax=4"
DROP_WAIT_S = 60.0
# Run on a node by Srun.drop: SIGKILL to this job's agent there (its argv holds the mark, its environment the node).
_END_AGENT = """import os, signal
node = ("SLURMD_NODENAME=" + os.environ.get("SLURMD_NODENAME", "?")).encode()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{{pid}}/cmdline", "rb").read().split(b"\\0")
        environ = open(f"/proc/{{pid}}/environ", "rb").read().split(b"\\0")
    except OSError:
        continue
    if b"pretrain.launch.agent" in argv and b"{mark}" in argv and node in environ:
        os.kill(int(pid), signal.SIGKILL)
"""
# What a task step must not inherit from a per-task batch request: one task per node has to see all its GPUs.
_PER_TASK_REQUESTS = ("SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK", "SLURM_NTASKS_PER_GPU", "SLURM_GPU_BIND")


def remote_word(arg: str) -> str:
    """One word of the remote command, already pdsh-quoted (pretrain/distributed/cluster.py's pdsh_quote): wrapped in
    "..." when it holds a space, as DeepSpeed's pdsh runner did, which pdsh_quote was written for."""
    return '"{}"'.format(arg.replace('"', '\\"')) if " " in arg else arg


@dataclass(frozen=True)
class SessionEnd:
    """A node's session ended, as its transport says: the status (128 + N: killed by signal N, or its machine lost)
    and, when the transport says more than a status, what happened in its words."""

    host: str
    status: int
    why: str = ""


class Pdsh:
    """The agents of a hostfile job, through pdsh + ssh; `module_args` arrive pdsh-quoted.

    node_env: NAME -> VALUE for every node's agent (and its ranks), shipped in a file while `shipped()` holds;
    workdir: the folder every node `cd`s to (default: this process's), where that file's folder is made."""

    def __init__(self, mark: str, node_env: Mapping[str, str] | None = None, python: str = sys.executable,
                 workdir: str | None = None) -> None:
        self.mark, self.node_env, self.python = mark, dict(node_env or {}), python
        self.env_file = EnvFile(self.node_env, Path(workdir or os.getcwd()))

    def command(self, hosts: Sequence[str], agent_args: Sequence[str], module_args: Sequence[str],
                resume_command: str) -> list[str]:
        """pdsh's command line: the working folder and the env file's path quoted for the node's shell (a `cd` or
        a file that fails ends the node's shell with one line: its agent never starts elsewhere), then the agent."""
        setup = f"cd {remote_quote(str(self.env_file.parent))} || exit {NOT_SHARED_STATUS};"
        if self.node_env:
            setup += " " + source_command(str(self.env_file.path), str(self.env_file.path.parent))
        agent = ["-u", "-m", "pretrain.launch.agent", *agent_args, "--job", self.mark, "--node", "%h",
                 "--resume-command", pdsh_quote(resume_command), "--", *module_args]
        return self._pdsh(hosts, [setup, remote_quote(self.python), *(remote_word(word) for word in agent)])

    @contextmanager
    def shipped(self) -> Iterator[None]:
        """The env file written (when there is a variable to ship) for the agents' start; removed at the job's end."""
        self.env_file.values = dict(self.node_env)
        if self.node_env:
            self.env_file.write()
        try:
            yield
        finally:
            self.env_file.remove()

    def env(self) -> dict[str, str]:
        # ssh's keep-alive: a machine that vanishes without closing its connections (power, network) ends its
        # session within about a minute, so the node is told lost (unset, ssh would wait for ever).
        alive = " ".join(filter(None, [os.environ.get("PDSH_SSH_ARGS_APPEND", ""), SSH_KEEP_ALIVE]))
        return {**os.environ, "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": alive}

    @staticmethod
    def session_end(line: str) -> SessionEnd | None:
        """From pdsh's line; status 128 + N when pdsh's ssh itself was killed by signal N."""
        ended = _PDSH_END.match(line)
        if not ended:
            return None
        return SessionEnd(ended[1], int(ended[2]) if ended[2] else 128 + int(ended[3]))

    @staticmethod
    def quiet(line: str) -> bool:
        del line
        return False

    def signal(self, signum: int, hosts: Sequence[str]) -> None:
        # the agents alone: pdsh, ssh and the remote shell also carry the mark in their command lines
        agents = shlex.quote(f"^[^ ]*python[^ ]* -u -m pretrain[.]launch[.]agent .*--job {self.mark} ")
        subprocess.run(self._pdsh(hosts, ["pkill", f"-{signal.Signals(signum).name[3:]}", "-f", agents]),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env(), check=False)

    def drop(self, host: str) -> bool:
        """Kill `host`'s agent alone (its ranks die with it: PR_SET_PDEATHSIG): the node leaves the job as a lost
        one. pkill matches its --node, so on a machine that runs several nodes' agents only that one ends."""
        agent = shlex.quote(self.agent_pattern(host))
        subprocess.run(self._pdsh([host], ["pkill", "-KILL", "-f", agent]), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env=self.env(), check=False)
        return True

    def store_problem(self, host: str, store: tuple[str, int]) -> str | None:
        """None when `host` reaches the rendezvous store, else what it said (its last line): asked once, before any
        agent starts, so a firewall between the nodes and this machine is one line, not every agent's join timeout."""
        code = f'import socket;socket.create_connection(("{store[0]}",{store[1]}),10)'  # no % for pdsh to expand
        try:
            proc = subprocess.run(self._pdsh([host], [remote_quote(self.python), "-c", shlex.quote(code)]),
                                  capture_output=True, text=True, env=self.env(), timeout=60, check=False)
        except subprocess.TimeoutExpired:
            return "no answer in 60 s"
        if proc.returncode == 0:
            return None
        said = [line.partition(": ")[2] for line in proc.stderr.splitlines() if line.startswith(f"{host}: ")]
        return (said or proc.stderr.strip().splitlines() or [f"status {proc.returncode}"])[-1]

    def agent_pattern(self, host: str) -> str:
        """The extended regex (pkill -f) of `host`'s agent command line, as `command` starts it."""
        return f"^[^ ]*python[^ ]* -u -m pretrain[.]launch[.]agent .*--job {self.mark} --node {re.escape(host)}( |$)"

    @staticmethod
    def _pdsh(hosts: Sequence[str], command: Sequence[str]) -> list[str]:
        return ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), *command]


class Srun:
    """The agents of a SLURM job: one step, one task per node; `module_args` arrive as typed.

    cpus_per_task: the job's cpus-per-task (one rank's share; unset: 1), so the agent's task asks for ranks x that;
    gpus: the ranks use GPUs, so the task asks for `ranks` GPUs of its node.
    """

    def __init__(self, mark: str, job_id: str, ranks_per_node: int, cpus_per_task: int | None = None,
                 gpus: bool = False, may_lose_nodes: bool = False, python: str = sys.executable,
                 excluded: Sequence[str] = ()) -> None:
        self.mark, self.job_id, self.ranks, self.python = mark, job_id, ranks_per_node, python
        self.excluded = list(excluded)  # hosts this job dropped before (a requeue): no agent there
        self.cpus_per_task, self.gpus, self.may_lose_nodes = cpus_per_task, gpus, may_lose_nodes
        self.step = ""
        self.signalled = False
        self.node_env: dict[str, str] = {}  # NAME -> VALUE for the agents: srun's environment (--export=ALL), not argv

    def command(self, hosts: Sequence[str], agent_args: Sequence[str], module_args: Sequence[str],
                resume_command: str) -> list[str]:
        # --kill-on-bad-exit=0: a task that ends does not end the others (nodes.py decides: carry on, or stop
        # them with one line); --no-kill: neither does a node SLURM sees fail, with --nodes MIN:MAX.
        srun = ["srun", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
                f"--job-name={self.mark}", "--kill-on-bad-exit=0", "--export=ALL"]
        # each rank's CPUs, as when every rank was a task: the job's cpus-per-task, else SLURM's default of one
        srun.append(f"--cpus-per-task={(self.cpus_per_task or 1) * self.ranks}")
        if self.gpus:
            srun.append(f"--gpus-per-node={self.ranks}")
        if self.may_lose_nodes:
            srun.append("--no-kill")
        if self.excluded:
            srun.append(f"--exclude={','.join(self.excluded)}")
        return [*srun, self.python, "-u", "-m", "pretrain.launch.agent", *agent_args, "--job", self.mark,
                "--slurm", "--resume-command", resume_command, "--", *module_args]

    def env(self) -> dict[str, str]:
        return {**{key: value for key, value in os.environ.items() if key not in _PER_TASK_REQUESTS}, **self.node_env}

    @contextmanager
    def shipped(self) -> Iterator[None]:
        """Nothing to write: srun hands env() to the tasks through slurmd."""
        yield

    @staticmethod
    def session_end(line: str) -> SessionEnd | None:
        """From srun's line for a task that ended badly (status 128 + N for a signal N), or for a node SLURM declared
        failed; an out-of-memory end is said as such (its status unknown: a kill, 128 + SIGKILL)."""
        failed = _SRUN_NODE_FAIL.match(line)
        if failed:
            return SessionEnd(failed[1], 128 + signal.SIGKILL, "SLURM declared the node failed")
        ended = _SRUN_END.match(line)
        if not ended:
            return None
        how = ended[2]
        if how.startswith("Exited with exit code "):
            return SessionEnd(ended[1], int(how.rsplit(" ", 1)[1]))
        if how == SRUN_OOM:
            return SessionEnd(ended[1], 128 + signal.SIGKILL, "SLURM reports its task out of memory")
        return SessionEnd(ended[1], 128 + _SIGNAL_WORDS.get(how, 0))

    def quiet(self, line: str) -> bool:
        """srun's closing word after a task it lost (the lost-node line has said it), and slurmstepd's "STEP ...
        CANCELLED" after a SIGTERM of ours (scancel --signal only signals: the agents stop their ranks)."""
        return line.startswith("srun: Force Terminated ") or (self.signalled and _STEP_CANCELLED.match(line) is not None)

    def signal(self, signum: int, hosts: Sequence[str]) -> None:
        """`signum` to every process of the agents' step (agents and ranks alike; both handle it)."""
        del hosts  # a step is signalled whole; a lost node's part of it is gone already
        step = self._step_id()
        if step:
            self.signalled = True
            subprocess.run(["scancel", f"--signal={signal.Signals(signum).name[3:]}", step],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    @staticmethod
    def store_problem(host: str, store: tuple[str, int]) -> str | None:
        """Not asked: under SLURM the store is served on the batch node, the allocation's first node."""
        del host, store
        return None

    def drop(self, host: str) -> bool:
        """End `host`'s agent alone (its ranks die with it): scancel signals a step whole, so an overlapping step of
        one task on that node (`srun --overlap -w HOST`) kills the processes there that are this job's agent on that
        node (its mark on the command line, SLURMD_NODENAME=HOST in its environment: several slurmd may share one
        machine). Bounded: a node that does not answer in DROP_WAIT_S is left to SLURM."""
        code = _END_AGENT.format(mark=self.mark)
        command = ["srun", "--overlap", f"--jobid={self.job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
                   "--kill-on-bad-exit=0", "--export=ALL", self.python, "-c", code]
        try:
            subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env(),
                           timeout=DROP_WAIT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return True

    def _step_id(self, wait_s: float = 30.0) -> str:
        """JOB.STEP of the agents' step, found by its name (the mark); waits while srun is still starting it."""
        deadline = time.monotonic() + wait_s
        while not self.step:
            listed = subprocess.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], capture_output=True,
                                    text=True, check=False).stdout
            self.step = next((line.split()[0] for line in listed.splitlines()
                              if line.split()[1:] == [self.mark]), "")
            if self.step or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return self.step
