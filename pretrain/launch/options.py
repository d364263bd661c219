"""The LAUNCH OPTIONS of `./launch.sh pretrain|squad|glue`: their table, how a command line splits into them and the
module's own arguments, and the --help text, which lists them from the same table the parser reads.

pretrain/launch/plan.py checks what they say and decides the launch; this module only reads them. Standard library
only, as plan.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pretrain.distributed.cluster import ClusterError

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
    "--master-addr": ("master_addr", "--master-addr A", (
        "rendezvous host (default: 127.0.0.1; pretrain on nodes: this machine, where launch.sh serves the",
        "rendezvous store; fine-tunes: the first hostfile host / SLURM node)")),
    "--master-port": ("master_port", "--master-port P",
                      ("rendezvous port (default: 29500; under SLURM 20000 + job id % 20000)",)),
    "--rdzv-endpoint": ("rdzv_endpoint", "--rdzv-endpoint HOST:PORT", (
        "pretrain on nodes: the rendezvous store (as torchrun's); on this machine launch.sh serves it, on",
        "another it must already run there (python -m pretrain.launch.store --host HOST --port PORT); instead of",
        "--master-addr/--master-port (docs/launching.md)")),
}  # fmt: skip
CPU_OPTION = ("--cpu", ("CPU ranks over gloo (DS_ACCELERATOR=cpu) instead of GPUs; needs --gpus N",))
NO_CHECK_OPTION = ("--no-check", ("pretrain: skip the launch-time check of the run (config, DeepSpeed JSONs,",
                                  "batch, shards, run folder), e.g. when this machine cannot see the nodes' files;",
                                  "the ranks still check"))
# Where the ranks run when no --launcher is given, between --hostfile and --launcher in the usage text.
AUTO_CHOICES = (
    ("SLURM", ("inside an allocation (SLURM_JOB_ID set): pretrain: one srun task per node, our elastic agent;",
               "fine-tunes: one srun task per GPU, RANK/WORLD_SIZE/LOCAL_RANK from SLURM_PROCID/SLURM_NTASKS/",
               "SLURM_LOCALID, MASTER_ADDR = first node")),
    ("local", ("otherwise: this machine's GPUs (pretrain: torch's elastic agent, docs/faults.md)",)),
)  # fmt: skip
@dataclass
class LaunchOptions:
    """The LAUNCH OPTIONS of one command line, as typed (strings: an error message quotes what was given)."""

    launcher: str = "auto"
    gpus: str = ""
    nodes: str = ""
    hostfile: str = ""
    master_addr: str = ""
    master_port: str = ""
    rdzv_endpoint: str = ""
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
  export CHECKPOINT OUT [--tag TAG]   python -m pretrain.export (a tag other than latest; export --help)
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
  sbatch slurm/slurm_pretrain.sbatch ds_configs/recipes/bert_large_64k.json
  codistillation as two separate allocations that meet in a shared folder (docs/codistillation.md):
  sbatch slurm/slurm_pretrain.sbatch ds_configs/recipes/bert_large_codistill.json --codistill.group=0 \\
      --codistill.exchange=filesystem --codistill.exchange_dir=/shared/exchange     (and group=1)
"""


def usage() -> str:
    """`./launch.sh --help`: the LAUNCH OPTIONS part comes from the tables the parser uses."""
    entries = [VALUE_OPTIONS["--hostfile"][1:], *AUTO_CHOICES]
    entries += [VALUE_OPTIONS[name][1:] for name in VALUE_OPTIONS if name != "--hostfile"]
    entries += [CPU_OPTION, NO_CHECK_OPTION, ("--", ("pass everything after it to the Python module unchanged",))]
    return _USAGE_HEAD + "".join(_usage_entry(left, lines) for left, lines in entries) + _USAGE_TAIL
