"""launch.sh's decisions, written once in Python: the launch options, the launcher, the ranks' environment.

`./launch.sh pretrain` and `./launch.sh squad finetune` hand their arguments here, once per launch:

    python -m pretrain.launch.plan [--prog NAME] launch [--dry-run] [--check-run] [--cpu-count N] pretrain|finetune -- ARGS...
    python -m pretrain.launch.plan [--prog NAME] usage

`launch` parses and checks the LAUNCH OPTIONS (and for pretrain --config and the --section.key=value
form of overrides), chooses the launcher (--hostfile, else a SLURM allocation, else this machine), asks
pretrain/distributed/cluster.py what the cluster says (`cluster.plan`), and prints what launch.sh needs as shell
assignments to eval: LAUNCHER, HOSTFILE, NODE_RANGE, MODULE_ARGS, the CLUSTER_* values (with CLUSTER_RDZV_ENDPOINT
for a pretrain on several nodes: where its rendezvous store listens, pretrain/launch/rendezvous.py), RANK_ENV (the
NAME=VALUE defaults every rank gets) and, for a hostfile, DS_ENV (every node's env lines). Bad input is one "PROG: error:
..." line and exit status 2, before anything starts. launch.sh keeps running, printing, exporting, signals.

`--check-run` (launch.sh passes it for pretrain) then runs the launch-time check of the run itself in
this same process, for the world size just planned and, with --nodes MIN:MAX, the batch arithmetic of every node
count a restart may have (pretrain/launch/preflight.py: config keys, DeepSpeed JSONs, batch arithmetic, shards,
run folder): a problem is one "PROG: config error: ..." line and
exit status 2, so no launcher, rank or node is started for a run that would fail at start-up. Under
--dry-run it is a note. It imports numpy and pyarrow (never torch), so only then, not at the top.

Why not bash: parsing, checking and merging are functions with unit tests here (tests/launch/test_launch_plan.py),
and the option table feeds both the parser and the usage text (pretrain/launch/options.py). Standard library only, like cluster.py: a
--dry-run on a laptop may run this with a bare python3 that has none of the toolkit's dependencies.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pretrain.distributed.cluster import (
    ClusterError,
    allocation_hosts,
    default_master_port,
    plan,
    read_hostfile,
    shell_assignments,
)
from pretrain.distributed.step_watch import HOLD_FILE_ENV
from pretrain.launch.node_env import parse_env_lines
from pretrain.launch.nodes import node_range
from pretrain.launch.options import VALUE_OPTIONS, LaunchOptions, parse_launch_options, usage
from pretrain.launch.rendezvous import endpoint, parse_endpoint, this_machine

__all__ = [
    "LAUNCHERS", "VALUE_OPTIONS", "LaunchOptions", "choose_launcher", "ds_env_lines", "launch_values",
    "parse_launch_options", "pretrain_config", "rank_env", "rendezvous_endpoint", "usage",
]

LAUNCHERS = ("auto", "local", "hostfile", "slurm", "none")

_UINT = re.compile(r"[0-9]+", re.ASCII)
_OVERRIDE = re.compile(r"--.*\..*=.*", re.DOTALL)  # --section.key=value, checked by pretrain.train itself


def _count(value: str, option: str) -> int | None:
    """A positive integer option ("" = not given); the error names the option and quotes the value."""
    if value and not (_UINT.fullmatch(value) and int(value) > 0):
        raise ClusterError(f"{option} must be a positive integer, got '{value}'")
    return int(value) if value else None


def choose_launcher(options: LaunchOptions, env: Mapping[str, str]) -> str:
    """The launcher to use, after checking that the options fit it and each other.

    auto: a hostfile when given, else SLURM inside an allocation (SLURM_JOB_ID set), else this machine.
    """
    launcher = options.launcher
    if launcher not in LAUNCHERS:
        raise ClusterError(f"--launcher must be auto, local, hostfile, slurm or none, got '{launcher}'")
    gpus, nodes = _count(options.gpus, "--gpus"), (node_range(options.nodes) or (None, None))[1]
    port = options.master_port
    if port and not (_UINT.fullmatch(port) and 0 < int(port) < 65536):
        raise ClusterError(f"--master-port must be a port number (1-65535), got '{port}'")
    if launcher == "auto":
        launcher = "hostfile" if options.hostfile else "slurm" if env.get("SLURM_JOB_ID") else "local"
    if launcher == "hostfile" and not options.hostfile:
        raise ClusterError("--launcher hostfile needs --hostfile FILE")
    if launcher != "hostfile" and options.hostfile:
        raise ClusterError(f"--hostfile cannot be combined with --launcher {launcher}")
    if launcher == "slurm" and not env.get("SLURM_JOB_ID"):
        raise ClusterError("--launcher slurm: not inside a SLURM allocation (SLURM_JOB_ID is unset); use sbatch/salloc")
    if launcher == "none" and gpus not in (None, 1):
        raise ClusterError(f"--launcher none runs one process; drop --gpus {options.gpus} or pick another launcher")
    if launcher in ("local", "none") and nodes not in (None, 1):
        raise ClusterError(f"--nodes {options.nodes} needs --hostfile or a SLURM allocation")
    if options.rdzv_endpoint:
        parse_endpoint(options.rdzv_endpoint)
        if launcher not in ("hostfile", "slurm"):
            raise ClusterError("--rdzv-endpoint is for pretrain on several nodes: it needs --hostfile or a SLURM "
                               "allocation")
        if options.master_addr or options.master_port:
            raise ClusterError("give --rdzv-endpoint HOST:PORT or --master-addr/--master-port, not both")
    if options.cpu and gpus is None and launcher != "none":
        raise ClusterError("--cpu needs --gpus N (the number of CPU ranks per node)")
    return launcher


def pretrain_config(options: LaunchOptions) -> str:
    """The --config of a `pretrain` command line; any other option before "--" must be an override.

    pretrain.train checks the overrides' names and values itself; a mistyped flag ("--lr 3") is caught
    here, before a launcher starts ranks that would each fail on it.
    """
    args = options.module_args
    checked = args if options.verbatim_from is None else args[: options.verbatim_from]
    config = ""
    for index, arg in enumerate(checked):
        if arg == "--config":
            config = args[index + 1] if index + 1 < len(args) else ""
        elif arg.startswith("--config="):
            config = arg.partition("=")[2]
        elif arg.startswith("--") and not _OVERRIDE.fullmatch(arg):
            raise ClusterError(
                f"pretrain: unknown option '{arg}' (overrides look like --section.key=value; see ./launch.sh --help)"
            )
    if not config:
        raise ClusterError("pretrain needs --config RUN.json")
    return config


def rank_env(env: Mapping[str, str], ranks: int, cpu_count: int, cpus_per_task: str = "",
             cpu: bool = False) -> dict[str, str]:
    """The variables launch.sh exports for every rank; a value the user set (non-empty) wins.

    OMP_NUM_THREADS: unset, every rank starts one thread per core (8 ranks on 64 cores: 512 threads),
    so the cores are split evenly (SLURM: the job's cpus-per-task). TOKENIZERS_PARALLELISM=false: the
    fast tokenizers' thread pool deadlocks after fork (DataLoader workers). NCCL_DEBUG=WARN: NCCL then
    says why a collective hangs without flooding logs. PYTHONUNBUFFERED=1: output when it happens.
    PYTHONPATH as launch.sh exported it (the checkout in front). DS_ACCELERATOR=cpu with --cpu only.
    TORCH_EXTENSIONS_DIR when set: where the ranks build and load DeepSpeed's ops (pdsh would drop it).
    PYTHONSAFEPATH=1: `python -m` would put the working folder first on the import path, where anyone who can
    write a shared working folder plants a `numpy.py` (the package is installed, or on PYTHONPATH: nothing of
    ours is imported from the working folder).
    """
    threads = cpus_per_task or str(max(1, cpu_count // max(ranks, 1)))
    values = {
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS") or threads,
        "TOKENIZERS_PARALLELISM": env.get("TOKENIZERS_PARALLELISM") or "false",
        "NCCL_DEBUG": env.get("NCCL_DEBUG") or "WARN",
        "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED") or "1",
        "PYTHONPATH": env.get("PYTHONPATH", ""),
        "PYTHONSAFEPATH": env.get("PYTHONSAFEPATH") or "1",
    }
    for name in ("TORCH_EXTENSIONS_DIR", HOLD_FILE_ENV):
        if env.get(name):
            values[name] = env[name]
    if cpu:
        values["DS_ACCELERATOR"] = "cpu"
    return values


def ds_env_lines(rank_values: Mapping[str, str], user_files: Sequence[Path],
                 note: Callable[[str], None] = print) -> list[str]:
    """The lines of the DeepSpeed env file (DS_ENV_FILE) for a hostfile launch.

    DeepSpeed's pdsh launcher forwards only NCCL*/PYTHON*/UCX*/MV2*/MLFLOW* variables to the other
    nodes; the rest of rank_env travels in this file. It keeps every NAME=VALUE line of the user's own
    ~/.deepspeed_env and ./.deepspeed_env (DeepSpeed reads only the file we name), and theirs win; a file
    someone else could have written is ignored with a note (trusted_text); a line that is not NAME=VALUE is a
    ClusterError naming the file and the line (pretrain/launch/node_env.py parse_env_lines).
    """
    user: dict[str, str] = {}
    for file in user_files:
        text = trusted_text(file, note)
        if text is not None:
            user.update(parse_env_lines(text.split("\n"), f"'{file}'"))  # as is: no newline translation
    ours = {name: value for name, value in rank_values.items() if name not in user}
    return [f"{name}={value}" for name, value in {**user, **ours}.items()]


def trusted_text(file: Path, note: Callable[[str], None]) -> str | None:
    """The text of a user's env file, or None when it is missing, not a plain file, or not trusted: it runs as
    the user on every node (LD_PRELOAD, PYTHONPATH), so it must be the user's own and writable by no one else; a
    ./.deepspeed_env planted in a shared working folder is ignored with one note saying why."""
    try:  # O_NONBLOCK: a FIFO planted under the name must not hold the launch
        descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ClusterError(f"'{file}' cannot be read: {err.strerror}") from None
    with os.fdopen(descriptor, "rb") as opened:
        status = os.fstat(opened.fileno())
        if not stat.S_ISREG(status.st_mode):
            return None
        if status.st_uid != os.geteuid():
            note(f"ignoring '{file}': it belongs to uid {status.st_uid}, not to you (uid {os.geteuid()})")
            return None
        if status.st_mode & 0o022:
            note(f"ignoring '{file}': others can write it (mode {stat.filemode(status.st_mode)}); chmod go-w it")
            return None
        return opened.read().decode("utf-8", "surrogateescape")


def rendezvous_endpoint(options: LaunchOptions, launcher: str, env: Mapping[str, str]) -> str:
    """HOST:PORT of a multi-node pretrain's rendezvous store (pretrain/launch/rendezvous.py): --rdzv-endpoint, else
    --master-addr (default: this machine as the nodes reach it) and --master-port (default: the launcher's)."""
    if options.rdzv_endpoint:
        return options.rdzv_endpoint
    port = int(options.master_port) if options.master_port else default_master_port(launcher, env)
    if options.master_addr:
        return endpoint(options.master_addr, port)
    if launcher == "hostfile":
        hosts = [host for host, _ in read_hostfile(options.hostfile)]
    else:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        hosts = allocation_hosts(nodelist, scontrol=True) if nodelist else []
    return endpoint(this_machine(hosts), port)


def _require_file(path: str, message: str, dry_run: bool, note: Callable[[str], None]) -> None:
    """An input an earlier step of a pipeline produces may be missing under --dry-run: a note there."""
    if Path(path).is_file():
        return
    if not dry_run:
        raise ClusterError(message)
    note(f"{message} (continuing: --dry-run)")


def launch_values(subcommand: str, args: Sequence[str], env: Mapping[str, str], *, cpu_count: int,
                  dry_run: bool = False, note: Callable[[str], None] = print,
                  user_env_files: Sequence[Path] = ()) -> dict[str, str | list[str]]:
    """Everything launch.sh needs to start `subcommand` (pretrain or finetune), as shell variable names. The checks
    run in the order a user fixes them: the options, pretrain's --config and its file, what the cluster says."""
    options = parse_launch_options(args)
    launcher = choose_launcher(options, env)
    module_args = list(options.module_args)
    if subcommand == "pretrain":
        config = pretrain_config(options)
        _require_file(config, f"pretrain: config file '{config}' does not exist", dry_run, note)
    else:
        module_args.insert(0, "finetune")
    if launcher == "none":
        cluster: dict[str, str | list[str]] = {"CLUSTER_RANKS": "1", "CLUSTER_CPUS_PER_TASK": "",
                                               "CLUSTER_MODULE_ARGS": module_args}
    else:
        most_nodes = (node_range(options.nodes) or (None, None))[1]
        cluster = plan(launcher, env, gpus=_count(options.gpus, "--gpus"), nodes=most_nodes,
                       hostfile=options.hostfile, master_addr=options.master_addr,
                       master_port=int(options.master_port) if options.master_port else None, cpu=options.cpu,
                       module_args=module_args)
    if subcommand == "pretrain" and launcher in ("hostfile", "slurm"):
        cluster["CLUSTER_RDZV_ENDPOINT"] = rendezvous_endpoint(options, launcher, env)
    ranks = rank_env(env, int(str(cluster["CLUSTER_RANKS"])), cpu_count, str(cluster["CLUSTER_CPUS_PER_TASK"]),
                     options.cpu)
    values: dict[str, str | list[str]] = {
        "LAUNCHER": launcher, "HOSTFILE": options.hostfile, "NODE_RANGE": options.nodes,
        "MODULE_ARGS": cluster.pop("CLUSTER_MODULE_ARGS"),  # pdsh-quoted where a remote shell splits them
        **cluster,
    }  # fmt: skip
    values["RANK_ENV"] = [f"{name}={value}" for name, value in ranks.items()]
    if launcher == "hostfile":
        values["DS_ENV"] = ds_env_lines(ranks, user_env_files, note)
    return values


# ---------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """The CLI of the module docstring; exit status 2 with "PROG: error: ..." on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module_args: list[str] = []
    if "--" in argv:  # split by hand: argparse would drop or mistake a "--" among the module's arguments
        argv, module_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prog", default="pretrain.launch.plan", help="name to prefix errors with (the caller)")
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser("launch", help="launch.sh's values for one launch, as shell assignments")
    launch.add_argument("subcommand", choices=["pretrain", "finetune"])
    launch.add_argument("--dry-run", action="store_true", help="a missing input is a note, not an error")
    launch.add_argument("--check-run", action="store_true", help="pretrain: the launch-time check of the run too")
    launch.add_argument("--cpu-count", type=int, default=1, help="CPUs of this machine (launch.sh: nproc)")
    commands.add_parser("usage", help="launch.sh's --help text")
    args = parser.parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):  # arguments and files that are not UTF-8 go back byte for byte
        sys.stdout.reconfigure(errors="surrogateescape")
    if args.command == "usage":
        sys.stdout.write(usage())
        return 0
    env = dict(os.environ)
    home = [Path(env["HOME"]) / ".deepspeed_env"] if env.get("HOME") else []
    try:
        values = launch_values(args.subcommand, module_args, env, cpu_count=args.cpu_count, dry_run=args.dry_run,
                               note=lambda text: print(f"{args.prog}: note: {text}", file=sys.stderr),
                               user_env_files=[*home, Path(".deepspeed_env")])
    except ClusterError as err:
        print(f"{args.prog}: error: {err}", file=sys.stderr)
        return 2
    options = parse_launch_options(module_args)
    if args.check_run and args.subcommand == "pretrain" and not options.no_check:
        ranks = int(str(values["CLUSTER_RANKS"]))
        nodes = int(str(values.get("CLUSTER_NODES", "1")))
        low = (node_range(options.nodes) or (nodes, nodes))[0]
        if not check_run(options, ranks, list(range(nodes, low - 1, -1)), args.prog, args.dry_run):
            return 2
    sys.stdout.write(shell_assignments(values))
    return 0


def check_run(options: LaunchOptions, ranks_per_node: int, node_counts: list[int], prog: str, dry_run: bool) -> bool:
    """The launch-time check (pretrain/launch/preflight.py) of pretrain's arguments as the ranks will get them, on
    `node_counts[0]` nodes, and the batch arithmetic on the others (--nodes MIN:MAX: a restart on fewer nodes);
    False (after one line on stderr) when the launch must not start. Under --dry-run a problem is a note: an
    earlier step of a pipeline (the demo's data prep) may not have run yet."""
    try:
        from pretrain.errors import ConfigError
        from pretrain.launch.preflight import LaunchShape, check_command_line
    except ImportError as err:  # a --dry-run on a bare python3: the check needs the toolkit's environment
        problem = f"error: the launch-time check needs the toolkit's environment: {err}"
    else:
        try:
            shape = LaunchShape(ranks_per_node * node_counts[0], "cpu" if options.cpu else "cuda", ranks_per_node,
                                tuple(node_counts[1:]))
            print(f"{prog}: {check_command_line(options.module_args, shape)}", file=sys.stderr)
            return True
        except ConfigError as err:
            problem = f"config error: {err}"
    if dry_run:
        print(f"{prog}: note: {problem} (continuing: --dry-run)", file=sys.stderr)
        return True
    print(f"{prog}: {problem}", file=sys.stderr)
    return False


if __name__ == "__main__":
    sys.exit(main())
