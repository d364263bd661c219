"""Cluster discovery, written once: what a launch reads from SLURM, a hostfile and this machine's GPUs.

launch.sh (through pretrain/launch/plan.py), slurm/slurm_rank.sh and pretrain/engine.py need the same
answers (the first node of a SLURM allocation, GPUs per node, the rendezvous host and port, which device
a task opens). Written once, as functions with unit tests (tests/distributed/test_cluster.py), they
cannot drift apart. launch_plan.py calls `plan` for launch.sh; slurm_rank.sh calls this module's CLI:

    python -m pretrain.distributed.cluster [--prog NAME] slurm-task                    (slurm_rank.sh, once per task)

It prints `export NAME=value` lines that the caller `eval`s, or "NAME: error: ..." on stderr and exit
status 2. One call that prints every value, rather than one query per value: one interpreter start per
task, every error phrased in one place, and bash parses nothing. The eval is safe by construction: the
names are fixed here and every value is quoted with shlex.quote (shell_assignments, which launch_plan.py
uses too), so no text from the environment, a hostfile or an argument is run.

Standard library only, and nothing else from `pretrain` is imported: launch.sh may run this with a
bare python3 (a --dry-run on a laptop) that has none of the toolkit's dependencies.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from pretrain.errors import exit_on_error

__all__ = [
    "ClusterError", "allocation_hosts", "default_master_addr", "default_master_port", "device_index", "first_host",
    "gpus_per_node", "local_gpu_count", "nodelist_hosts", "pdsh_quote", "per_node_counts", "plan",
    "read_hostfile", "remote_quote", "shell_assignments", "slurm_task_env", "visible_devices",
]

LOCAL_MASTER_PORT = 29500  # torch's and DeepSpeed's own default
SLURM_PORT_BASE = 20000
THROUGH_LAUNCH_SH = "start this through './launch.sh pretrain' inside a SLURM allocation"


class ClusterError(RuntimeError):
    """A cluster description this module cannot use; the message names the variable, file or line."""


# ---------------------------------------------------------------------------------------------- SLURM
_NODE_NAME = re.compile(r"(?:[^\[\],]|\[[^\[\]]*\])+")
_NODE_LIST = re.compile(rf"{_NODE_NAME.pattern}(?:,{_NODE_NAME.pattern})*")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)


def nodelist_hosts(nodelist: str) -> Iterator[str]:
    """Every host of a SLURM node list, in order: "gpu[003-004,010],cpu1" -> gpu003, gpu004, gpu010, cpu1.

    The hostlist syntax: comma-separated names, each with any number of bracketed groups of numbers
    and ranges (zero padding kept, "rack[1-2]-n[05-06]" too), expanded one name at a time. A malformed
    list is a ClusterError rather than a wrong host name.
    """
    if not _NODE_LIST.fullmatch(nodelist):
        raise ClusterError(f"cannot read the SLURM node list '{nodelist}' (unbalanced brackets or an empty name)")
    for name in _NODE_NAME.findall(nodelist):
        parts = re.split(r"\[([^\]]*)\]", name)  # literal, group, literal, group, ..., literal
        choices = [[part] if i % 2 == 0 else _expand_group(part, nodelist) for i, part in enumerate(parts)]
        for combination in itertools.product(*choices):
            yield "".join(combination)


def _expand_group(group: str, nodelist: str) -> list[str]:
    values = []
    for item in group.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ClusterError(f"cannot read the SLURM node list '{nodelist}': bad range '{item}' in [{group}]")
        low, high = match[1], match[2] or match[1]
        values += [f"{number:0{len(low)}d}" for number in range(int(low), int(high) + 1)]
    return values


def allocation_hosts(nodelist: str, scontrol: bool = False) -> list[str]:
    """Every host of a SLURM node list, in order: where srun starts its tasks.

    With `scontrol`, `scontrol show hostnames` answers where it works (it knows every syntax a site's
    SLURM version accepts); the built-in parser answers otherwise. Per-task callers pass False: no
    subprocess in each of thousands of tasks, and every task computes the same answer.
    """
    if scontrol and shutil.which("scontrol"):
        try:
            shown = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                   timeout=30).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            shown = []
        if shown:
            return shown
    return list(nodelist_hosts(nodelist))


def first_host(nodelist: str, scontrol: bool = False) -> str:
    """The first host of a SLURM node list: where srun starts task 0, so the rendezvous host."""
    return allocation_hosts(nodelist, scontrol)[0]


def per_node_counts(spec: str) -> list[int]:
    """SLURM's compressed per-node counts, expanded: "2(x3),1" -> [2, 2, 2, 1], "8" -> [8]."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item, re.ASCII)
        if not match:
            raise ClusterError(f"cannot read the SLURM count list '{spec}'")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def gpus_per_node(spec: str) -> int | None:
    """GPUs per node from SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE: "8", "a100:8", "gpu:a100:8", "4(x2)".

    A GPU type prefix is dropped; a per-node list gives its first node's count (the ranks per node are
    the same on every node); None when the value is unreadable.
    """
    try:
        return per_node_counts(re.sub(r"[^,:(]*:", "", spec))[0]
    except ClusterError:
        return None


def default_master_addr(launcher: str, env: Mapping[str, str], hosts: Sequence[tuple[str, int]] = (),
                        scontrol: bool = False) -> str:
    """The rendezvous host when none is given: where rank 0 runs.

    local (and a lone process): this machine; hostfile: its first host; SLURM: the allocation's first
    node, else the node srun was started from (SLURM_LAUNCH_NODE_IPADDR) where the list is missing.
    """
    if launcher == "hostfile":
        return hosts[0][0]
    if launcher != "slurm":
        return "127.0.0.1"
    if env.get("SLURM_JOB_NODELIST"):
        return first_host(env["SLURM_JOB_NODELIST"], scontrol)
    if env.get("SLURM_LAUNCH_NODE_IPADDR"):
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    raise ClusterError(f"SLURM_JOB_NODELIST is unset inside SLURM job {env.get('SLURM_JOB_ID', '?')}")


def default_master_port(launcher: str, env: Mapping[str, str]) -> int:
    """The rendezvous port when none is given: 29500, or under SLURM 20000 + SLURM_JOB_ID % 20000.

    Under SLURM every task derives the same port without talking, and two jobs sharing a node (their
    ids differ) do not collide on it.
    """
    if launcher != "slurm":
        return LOCAL_MASTER_PORT
    return SLURM_PORT_BASE + _integer(env, "SLURM_JOB_ID", "0") % SLURM_PORT_BASE


def _integer(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    value = env.get(name) or default
    if value is None or not value.isascii() or not value.strip().isdigit():
        raise ClusterError(f"{name} must be a non-negative integer, got '{value or ''}'")
    return int(value)


# ---------------------------------------------------------------------------------------------- devices
def device_index(local_rank: int, visible_devices: str | None) -> int:
    """The accelerator index a rank uses: its local rank, unless it sees exactly one device.

    SLURM's per-task GPU binding (`--gpus-per-task=1`, `--gpu-bind=single:1`) hands each task a
    CUDA_VISIBLE_DEVICES with one entry, so the only device the process can open is index 0, whatever
    its SLURM_LOCALID; using the local rank would fail with an invalid device ordinal on every task
    but the first of a node.
    """
    devices = [entry for entry in (visible_devices or "").split(",") if entry.strip()]
    return 0 if len(devices) == 1 else local_rank


def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES's entries, or None when it is unset or blank (no selection made)."""
    entries = [entry.strip() for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return entries or None


def local_gpu_count(env: Mapping[str, str]) -> int:
    """GPUs on this machine: the CUDA_VISIBLE_DEVICES selection, else the GPUs `nvidia-smi -L` lists, else 0."""
    visible = visible_devices(env)
    if visible is not None:
        return len(visible)
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU") for line in listing.splitlines())


# ---------------------------------------------------------------------------------------------- hostfile
_HOST_LINE = re.compile(r"\s*(\S+)\s+slots=(\d+)\s*", re.ASCII)
# A host name as RFC 1123 spells it (labels of letters, digits and inner '-', joined by '.'; an IPv4 address is
# one too). Nothing else: pdsh reads "a,b" as two hosts and "a[1-9]" as nine, and "user@host" as another account.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*", re.ASCII)


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """(host, slots) for each line "HOST slots=N" of an MPI-style hostfile; "#" comments and blank lines skip.

    Checked here rather than by DeepSpeed, whose runner reports a bad line only after it started. HOST must be
    a host name (HOST_NAME): each one becomes a word of pdsh's host list, where `node1,node9 slots=8` would start
    an agent on node9 too.
    """
    file = Path(path)
    if not file.is_file():
        raise ClusterError(f"hostfile '{path}' does not exist")
    try:
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise ClusterError(f"hostfile '{path}' cannot be read: {err.strerror}") from None
    hosts = []
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.split("#", 1)[0]
        if not line.strip():
            continue
        match = _HOST_LINE.fullmatch(line)
        if not match:
            raise ClusterError(f"hostfile '{path}' line {number}: expected 'HOSTNAME slots=N', got '{line.strip()}'")
        if not HOST_NAME.fullmatch(match[1]):
            raise ClusterError(f"hostfile '{path}' line {number}: '{match[1]}' is not a host name (letters, digits, "
                               "'-' and '.', or an IPv4 address)")
        hosts.append((match[1], int(match[2])))
    if not hosts:
        raise ClusterError(f"hostfile '{path}' lists no host")
    return hosts


_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def pdsh_quote(arg: str) -> str:
    """`arg` quoted once more for DeepSpeed's pdsh path, so that the rank receives exactly `arg`.

    DeepSpeed's pdsh runner joins the remote command into one string that pdsh sends over ssh to each
    node's login shell, which splits it again: unquoted, --run.phases=["phase1"] arrives as [phase1],
    {a,b} is brace-expanded, $X expanded, and pdsh itself replaces %n/%h/%u and %%. DeepSpeed passes
    an argument without a space as is and wraps one with a space in "..." (escaping only its "). So:
    single quotes when there is no space, else escape what stays special inside "..." (\\ $ `); then
    double every %. tests/launch/test_hostfile.py checks it end to end through real pdsh + ssh.
    """
    if _PLAIN_WORD.fullmatch(arg):
        word = arg
    elif " " in arg:
        word = arg.replace("\\", "\\\\").replace("$", "\\$").replace("`", "\\`")
    else:
        word = "'" + arg.replace("'", "'\\''") + "'"
    return word.replace("%", "%%")


def remote_quote(text: str) -> str:
    """`text` as one word of a remote command that pdsh sends through ssh to a node's shell, which gets exactly
    `text`: shlex.quote for that shell's one parse, then every % doubled for pdsh's own %h/%n/%u expansion.
    For the working folder and anything else we put in the remote command ourselves (pdsh_quote is for the
    module arguments, whose quoting DeepSpeed's runner finishes)."""
    return shlex.quote(text).replace("%", "%%")


# ---------------------------------------------------------------------------------------------- per task
def slurm_task_env(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's variables for one srun task, from SLURM's per-task ones.

    RANK, WORLD_SIZE, NODE_RANK, LOCAL_WORLD_SIZE (this node's entry of SLURM_TASKS_PER_NODE) and
    LOCAL_RANK as the device index (device_index); MASTER_ADDR/MASTER_PORT kept when set (launch.sh
    exports them), else the SLURM defaults. slurm_rank.sh exports these before it becomes the rank;
    init_distributed uses them for tasks srun started without that wrapper.
    """
    for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"):
        if not env.get(name):
            raise ClusterError(f"{name} is unset; {THROUGH_LAUNCH_SH}")
    node = _integer(env, "SLURM_NODEID", "0")
    values = {
        "RANK": str(_integer(env, "SLURM_PROCID")),
        "LOCAL_RANK": str(device_index(_integer(env, "SLURM_LOCALID"), env.get("CUDA_VISIBLE_DEVICES"))),
        "WORLD_SIZE": str(_integer(env, "SLURM_NTASKS")),
        "NODE_RANK": str(node),
    }
    tasks = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if tasks:
        counts = per_node_counts(tasks)
        values["LOCAL_WORLD_SIZE"] = str(counts[node] if node < len(counts) else counts[0])
    try:
        values["MASTER_ADDR"] = env.get("MASTER_ADDR") or default_master_addr("slurm", env)
    except ClusterError:
        raise ClusterError(f"MASTER_ADDR is unset, and so is SLURM_JOB_NODELIST; {THROUGH_LAUNCH_SH}") from None
    values["MASTER_PORT"] = env.get("MASTER_PORT") or str(default_master_port("slurm", env))
    return values


# ---------------------------------------------------------------------------------------------- launch plan
def plan(launcher: str, env: Mapping[str, str], *, gpus: int | None = None, nodes: int | None = None,
         hostfile: str = "", master_addr: str = "", master_port: int | None = None, cpu: bool = False,
         module_args: Sequence[str] = ()) -> dict[str, str | list[str]]:
    """Everything launch.sh derives for `launcher` (local, hostfile or slurm), as CLUSTER_* names.

    RANKS (per node), NODES, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LAUNCHER_ARGS (local: --num_gpus N
    or --include localhost:<CUDA_VISIBLE_DEVICES>, since DeepSpeed ignores that variable once
    --num_gpus is given; hostfile: --num_nodes/--num_gpus; slurm: --cpus-per-task for srun, which since
    Slurm 22.05 no longer inherits it); CPUS_PER_TASK; MODULE_ARGS, pdsh-quoted when REMOTE_SHELL is 1.
    launch_plan.py checked the options; a ClusterError here is about what the cluster says.
    """
    launcher_args: list[str] = []
    cpus_per_task = ""
    if launcher == "local":
        ranks = gpus if gpus is not None else local_gpu_count(env)
        if ranks <= 0:
            raise ClusterError(
                "no GPU found on this machine (nvidia-smi); pass --gpus N, or --cpu --gpus N for CPU ranks"
            )
        used, hosts = 1, []
        launcher_args = ["--num_gpus", str(ranks)]
        visible = visible_devices(env)
        if visible is not None and not cpu:
            if ranks > len(visible):
                raise ClusterError(
                    f"--gpus {ranks} but CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} shows {len(visible)} GPU(s)"
                )
            launcher_args = ["--include", "localhost:" + ",".join(visible[:ranks])]
    elif launcher == "hostfile":
        hosts = read_hostfile(hostfile)
        if nodes is not None and nodes > len(hosts):
            raise ClusterError(f"--nodes {nodes} but hostfile '{hostfile}' lists {len(hosts)} host(s)")
        used = nodes or len(hosts)
        ranks = gpus or hosts[0][1]
        launcher_args = (["--num_nodes", str(nodes)] if nodes else []) + (["--num_gpus", str(gpus)] if gpus else [])
    elif launcher == "slurm":
        job, hosts = env.get("SLURM_JOB_ID", "?"), []
        allocated = _integer(env, "SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES") or "1")
        used = nodes or allocated
        if used > allocated:
            raise ClusterError(f"--nodes {used} but SLURM job {job} has {allocated} node(s)")
        spec = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE")
        ranks = gpus or (gpus_per_node(spec) if spec else local_gpu_count(env)) or 0
        if ranks <= 0:
            raise ClusterError(f"cannot tell how many GPUs each node of SLURM job {job} has; pass --gpus N")
        cpus_per_task = env.get("SLURM_CPUS_PER_TASK", "")
        if cpus_per_task:
            if not (cpus_per_task.isascii() and cpus_per_task.isdigit() and int(cpus_per_task) > 0):
                raise ClusterError(f"SLURM_CPUS_PER_TASK must be a positive integer, got '{cpus_per_task}'")
            launcher_args = [f"--cpus-per-task={cpus_per_task}"]
    else:
        raise ClusterError(f"plan: unknown launcher '{launcher}' (local, hostfile or slurm)")
    remote_shell = launcher == "hostfile" and used > 1  # with one node DeepSpeed runs the ranks without a shell
    return {
        "CLUSTER_RANKS": str(ranks),
        "CLUSTER_NODES": str(used),
        "CLUSTER_WORLD_SIZE": str(used * ranks),
        "CLUSTER_MASTER_ADDR": master_addr or default_master_addr(launcher, env, hosts, scontrol=True),
        "CLUSTER_MASTER_PORT": str(master_port or default_master_port(launcher, env)),
        "CLUSTER_LAUNCHER_ARGS": launcher_args,
        "CLUSTER_CPUS_PER_TASK": cpus_per_task,
        "CLUSTER_REMOTE_SHELL": "1" if remote_shell else "0",
        "CLUSTER_MODULE_ARGS": [pdsh_quote(arg) for arg in module_args] if remote_shell else list(module_args),
    }


# ---------------------------------------------------------------------------------------------- CLI
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def shell_assignments(values: Mapping[str, str | Sequence[str]], export: bool = False) -> str:
    """bash assignments of `values`, one a line, safe to `eval`: NAME='...' and NAME=('...' '...')."""
    lines = []
    for name, value in values.items():
        if not _SHELL_NAME.fullmatch(name):
            raise ValueError(f"not a shell variable name: {name!r}")
        if isinstance(value, str):
            text = shlex.quote(value)
        elif export:
            raise ValueError(f"bash cannot export the array {name}")
        else:
            text = "(" + " ".join(shlex.quote(item) for item in value) + ")"
        lines.append(f"{'export ' if export else ''}{name}={text}")
    return "".join(line + "\n" for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI of the module docstring; exit status 2 with "PROG: error: ..." on a ClusterError."""
    parser = argparse.ArgumentParser(prog="python -m pretrain.distributed.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prog", default="pretrain.distributed.cluster", help="name to prefix errors with (the caller)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("slurm-task", help="one srun task's RANK, LOCAL_RANK, ... as export lines")
    args = parser.parse_args(argv)
    return exit_on_error(lambda: sys.stdout.write(shell_assignments(slurm_task_env(dict(os.environ)), export=True)),
                         ClusterError, prefix=f"{args.prog}: error: ")


if __name__ == "__main__":
    sys.exit(main())
