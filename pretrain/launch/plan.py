"""launch.sh's decisions, written once in Python: the launch options, the launcher, the ranks' environment.

`./launch.sh pretrain` and `./launch.sh squad finetune` hand their arguments here, once per launch:

    python -m pretrain.launch.plan [--prog NAME] launch [--dry-run] [--check-run] [--cpu-count N] pretrain|finetune -- ARGS...
    python -m pretrain.launch.plan [--prog NAME] usage

`launch` parses and checks the LAUNCH OPTIONS (and for pretrain --config and the --section.key=value
form of overrides), chooses the launcher (--hostfile, else a SLURM allocation, else this machine), asks
pretrain/distributed/cluster.py what the cluster says (`cluster.plan`), and prints what launch.sh needs as shell
assignments to eval: LAUNCHER, HOSTFILE, NODE_RANGE, MODULE_ARGS, the CLUSTER_* values, RANK_ENV (the NAME=VALUE
defaults every rank gets) and, for a hostfile, DS_ENV (every node's env lines). Bad input is one "PROG: error:
..." line and exit status 2, before anything starts. launch.sh keeps running, printing, exporting, signals.

`--check-run` (launch.sh passes it for pretrain) then runs the launch-time check of the run itself in
this same process, for the world size just planned (pretrain/launch/preflight.py: config keys, DeepSpeed
JSONs, batch arithmetic, shards, run folder): a problem is one "PROG: config error: ..." line and
exit status 2, so no launcher, rank or node is started for a run that would fail at start-up. Under
--dry-run it is a note. It imports numpy and pyarrow (never torch), so only then, not at the top.

Why not bash: parsing, checking and merging are functions with unit tests here (tests/launch/test_launch_plan.py),
and the option table feeds both the parser and the usage text. Standard library only, like cluster.py: a
--dry-run on a laptop may run this with a bare python3 that has none of the toolkit's dependencies.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.distributed.cluster import ClusterError, plan, shell_assignments
from pretrain.launch.nodes import node_range

__all__ = [
    "LAUNCHERS", "LaunchOptions", "choose_launcher", "ds_env_lines", "launch_values", "parse_launch_options",
    "pretrain_config", "rank_env", "usage",
]

LAUNCHERS = ("auto", "local", "hostfile", "slurm", "none")

# The LAUNCH OPTIONS that take a value: spelling -> (LaunchOptions field, usage's left column, help lines).
# The parser reads its options from here and the usage text lists them (in this order, with the
# AUTO_CHOICES after --hostfile).
VALUE_OPTIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "--hostfile": ("hostfile", "--hostfile F", (
        'several nodes through pdsh/ssh (pretrain: our elastic agent on each; lines "host slots=N";',
        "the checkout must be at the same path on every node)")),
    "--launcher": ("launcher", "--launcher local|hostfile|slurm|none", (
        "force one (default: auto, as above); none = one plain",
        "process without a launcher (single rank, e.g. a small SQuAD fine-tune on CPU)")),
    "--gpus": ("gpus", "--gpus N", ("ranks per node (default: SLURM's GPUs per node, else nvidia-smi's count)",)),
    "--nodes": ("nodes", "--nodes N|MIN:MAX", ("the first N nodes of the hostfile / allocation; pretrain:",
                                             "MIN:MAX carries on while MIN nodes are left (docs/faults.md)")),
    "--master-addr": ("master_addr", "--master-addr A",
                      ("rendezvous host (default: 127.0.0.1 / first hostfile host / first SLURM node)",)),
    "--master-port": ("master_port", "--master-port P",
                      ("rendezvous port (default: 29500; under SLURM 20000 + job id % 20000)",)),
}  # fmt: skip
CPU_OPTION = ("--cpu", ("CPU ranks over gloo (DS_ACCELERATOR=cpu) instead of GPUs; needs --gpus N",))
NO_CHECK_OPTION = ("--no-check", ("pretrain: skip the launch-time check of the run (config, DeepSpeed JSONs,",
                                  "batch, shards, run folder), e.g. when this machine cannot see the nodes' files;",
                                  "the ranks still check"))
# Where the ranks run when no --launcher is given, between --hostfile and --launcher in the usage text.
AUTO_CHOICES = (
    ("SLURM", ("inside an allocation (SLURM_JOB_ID set): one srun task per GPU, RANK/WORLD_SIZE/",
               "LOCAL_RANK from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, MASTER_ADDR = first node")),
    ("local", ("otherwise: this machine's GPUs (pretrain: torch's elastic agent, docs/faults.md)",)),
)  # fmt: skip
_UINT = re.compile(r"[0-9]+", re.ASCII)
_OVERRIDE = re.compile(r"--.*\..*=.*", re.DOTALL)  # --section.key=value, checked by pretrain.train itself


@dataclass
class LaunchOptions:
    """The LAUNCH OPTIONS of one command line, as typed (strings: an error message quotes what was given)."""

    launcher: str = "auto"
    gpus: str = ""
    nodes: str = ""
    hostfile: str = ""
    master_addr: str = ""
    master_port: str = ""
    cpu: bool = False
    no_check: bool = False
    module_args: list[str] = field(default_factory=list)  # everything else, in order, for the Python module
    verbatim_from: int | None = None  # index in module_args where the arguments after "--" begin


def parse_launch_options(args: Sequence[str]) -> LaunchOptions:
    """Split `args` into LAUNCH OPTIONS and the module's arguments; "--" passes the rest on unread.

    Both "--opt VALUE" and "--opt=VALUE" work; an empty value counts as not given (the defaults apply).
    Only "needs a value" is checked here; choose_launcher checks the values and how they combine.
    """
    options = LaunchOptions()
    index = 0
    while index < len(args):
        arg = args[index]
        name, equals, value = arg.partition("=")
        if arg == "--cpu":
            options.cpu = True
        elif arg == "--no-check":
            options.no_check = True
        elif arg == "--":
            options.verbatim_from = len(options.module_args)
            options.module_args += args[index + 1 :]
            break
        elif name in VALUE_OPTIONS and equals:
            setattr(options, VALUE_OPTIONS[name][0], value)
        elif arg in VALUE_OPTIONS:
            if index + 1 == len(args):
                raise ClusterError(f"{arg} needs a value")
            index += 1
            setattr(options, VALUE_OPTIONS[arg][0], args[index])
        else:
            options.module_args.append(arg)
        index += 1
    return options


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
    """
    threads = cpus_per_task or str(max(1, cpu_count // max(ranks, 1)))
    values = {
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS") or threads,
        "TOKENIZERS_PARALLELISM": env.get("TOKENIZERS_PARALLELISM") or "false",
        "NCCL_DEBUG": env.get("NCCL_DEBUG") or "WARN",
        "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED") or "1",
        "PYTHONPATH": env.get("PYTHONPATH", ""),
    }
    if env.get("TORCH_EXTENSIONS_DIR"):
        values["TORCH_EXTENSIONS_DIR"] = env["TORCH_EXTENSIONS_DIR"]
    if cpu:
        values["DS_ACCELERATOR"] = "cpu"
    return values


def ds_env_lines(rank_values: Mapping[str, str], user_files: Sequence[Path]) -> list[str]:
    """The lines of the DeepSpeed env file (DS_ENV_FILE) for a hostfile launch.

    DeepSpeed's pdsh launcher forwards only NCCL*/PYTHON*/UCX*/MV2*/MLFLOW* variables to the other
    nodes; the rest of rank_env travels in this file. It keeps every NAME=VALUE line of the user's own
    ~/.deepspeed_env and ./.deepspeed_env (DeepSpeed reads only the file we name), and theirs win.
    """
    lines: list[str] = []
    for file in user_files:
        if file.is_file():
            text = file.read_bytes().decode("utf-8", "surrogateescape")  # as is: no newline translation
            lines += [line for line in text.split("\n") if "=" in line]
    user_keys = {line.partition("=")[0] for line in lines}
    return lines + [f"{name}={value}" for name, value in rank_values.items() if name not in user_keys]


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
    ranks = rank_env(env, int(str(cluster["CLUSTER_RANKS"])), cpu_count, str(cluster["CLUSTER_CPUS_PER_TASK"]),
                     options.cpu)
    values: dict[str, str | list[str]] = {
        "LAUNCHER": launcher, "HOSTFILE": options.hostfile, "NODE_RANGE": options.nodes,
        "MODULE_ARGS": cluster.pop("CLUSTER_MODULE_ARGS"),  # pdsh-quoted where a remote shell splits them
        **cluster,
    }  # fmt: skip
    values["RANK_ENV"] = [f"{name}={value}" for name, value in ranks.items()]
    if launcher == "hostfile":
        values["DS_ENV"] = ds_env_lines(ranks, user_env_files)
    return values


# ---------------------------------------------------------------------------------------------- usage
def _usage_entry(left: str, lines: Sequence[str]) -> str:
    first = f"  {left:<16} {lines[0]}" if len(left) <= 16 else f"  {left}   {lines[0]}"
    return "".join(line + "\n" for line in [first, *(" " * 19 + line for line in lines[1:])])


_USAGE_HEAD = """\
Usage: ./launch.sh [--dry-run] SUBCOMMAND [options]

Subcommands
  prep  ARGS...                    python -m data_prep build ARGS   (data_prep's flags, e.g.
                                   --wiki-dump F --books DIR --vocab-size N --seq-lens 128,512 --out DIR)
  prep  merge --out DIR            python -m data_prep merge (after a multi-node build)
  prep  inspect OUT                python -m data_prep inspect OUT
  pretrain --config RUN.json [LAUNCH OPTIONS] [--section.key=value ...]
                                   both pretraining phases on every rank (see LAUNCH OPTIONS)
  squad finetune [LAUNCH OPTIONS] --model DIR --train F --dev F --out DIR [...]
  squad evaluate DATA.json PREDICTIONS.json [...]
  glue finetune [LAUNCH OPTIONS] --task T --model DIR --data DIR --out DIR [--seeds N]
  glue evaluate --task T GOLD.tsv PREDICTIONS.tsv
  export CHECKPOINT OUT            python -m pretrain.checkpointing.export CHECKPOINT OUT
  report RUN_DIR [--usd-per-device-hour X]   report.md + report.png (time to quality), model cards
  tensorboard RUN_DIR [ARGS...]    TensorBoard on RUN_DIR
  scale RUN.json --phase1-batch N --phase2-batch M [--gpus G] --out NEW.json   the recipe at your batch
  demo [--sample-data DIR] [--out DIR] [...]
                                   the whole pipeline at toy scale on 2 CPU ranks (python -m pretrain.demo --help)

Global options
  --dry-run        print the commands, run nothing
  -h, --help       this help (after prep or demo: that module's own flags)

LAUNCH OPTIONS (pretrain, squad/glue finetune). Where the ranks run is chosen in this order:
"""
_USAGE_TAIL = """\
  SIGTERM/SIGUSR1/SIGINT/SIGHUP to launch.sh (or its group) reach the ranks, which checkpoint; launch.sh exits 0
  (130 after Ctrl-C): rerun the same command to resume. Nothing of the job outlives launch.sh, even kill -9

Environment defaults (only set when unset; documented in docs/launching.md, "Environment defaults")
  OMP_NUM_THREADS=cores/ranks-per-node (SLURM: cpus-per-task, also passed to srun)
  TOKENIZERS_PARALLELISM=false  NCCL_DEBUG=WARN
  PYTHONUNBUFFERED=1  PYTHONPATH=<repo>:$PYTHONPATH
  PYTHON = the interpreter (default: the active venv's, else <repo>/.venv's, else python3 on PATH)

Examples
  ./launch.sh demo --sample-data ../shared/data
  ./launch.sh pretrain --config ds_configs/recipes/bert_large_64k.json --gpus 8
  ./launch.sh pretrain --config RUN.json --hostfile hosts.txt --dry-run
  sbatch launch/slurm_pretrain.sbatch ds_configs/recipes/bert_large_64k.json
  codistillation as two separate allocations that meet in a shared folder (docs/codistillation.md):
  sbatch launch/slurm_pretrain.sbatch ds_configs/recipes/bert_large_codistill.json --codistill.group=0 \\
      --codistill.exchange=filesystem --codistill.exchange_dir=/shared/exchange     (and group=1)
"""


def usage() -> str:
    """`./launch.sh --help`: the LAUNCH OPTIONS part comes from the tables the parser uses."""
    entries = [VALUE_OPTIONS["--hostfile"][1:], *AUTO_CHOICES]
    entries += [VALUE_OPTIONS[name][1:] for name in VALUE_OPTIONS if name != "--hostfile"]
    entries += [CPU_OPTION, NO_CHECK_OPTION, ("--", ("pass everything after it to the Python module unchanged",))]
    return _USAGE_HEAD + "".join(_usage_entry(left, lines) for left, lines in entries) + _USAGE_TAIL


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
        world_size = int(str(values.get("CLUSTER_WORLD_SIZE", values["CLUSTER_RANKS"])))
        if not check_run(options, world_size, args.prog, args.dry_run):
            return 2
    sys.stdout.write(shell_assignments(values))
    return 0


def check_run(options: LaunchOptions, world_size: int, prog: str, dry_run: bool) -> bool:
    """The launch-time check (pretrain/launch/preflight.py) of pretrain's arguments as the ranks will get them, for
    `world_size` ranks; False (after one line on stderr) when the launch must not start. Under --dry-run a
    problem is a note: an earlier step of a pipeline (the demo's data prep) may not have run yet."""
    try:
        from pretrain.config.sections import ConfigError
        from pretrain.launch.preflight import LaunchShape, check_command_line
    except ImportError as err:  # a --dry-run on a bare python3: the check needs the toolkit's environment
        problem = f"error: the launch-time check needs the toolkit's environment: {err}"
    else:
        try:
            shape = LaunchShape(world_size, "cpu" if options.cpu else "cuda")
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
