"""The variables every node's agent gets in a hostfile launch, and how they reach it: a 0600 file on the shared file
system that the node's shell sources before the agent starts; never a command line.

pdsh puts its remote command on ssh's command line, and ssh puts it on the node's shell's: every user of the launch
host and of the nodes reads those with `ps`. The ranks' defaults (pretrain/launch/plan.py rank_env) and the lines of
the user's ~/.deepspeed_env (tokens, cloud keys) therefore travel in a file instead:

- written on the machine that runs launch.sh, in a fresh folder inside the working folder (`mkdtemp`: mode 0700, a
  name nobody can guess or take first), which every node `cd`s to and so must share (docs/launching.md);
- one `NAME='value'` line per variable: the name checked (ENV_NAME), the value shlex-quoted, so sourcing the file
  sets exactly those values, as written, and runs nothing else;
- sourced on each node through one open file descriptor (`source_command`): the node's shell opens the file once,
  checks that the open file is the user's own, and sources that same open file, so another user who can write the
  working folder cannot slip in a file of theirs between the check and the read;
- removed when the job ends (pretrain/launch/nodes.py).

Any variable can ride it: add NAME -> VALUE to the `node_env` mapping the transport is built with
(pretrain/launch/transports.py; nodes.py's build_job fills it from launch.sh's --env-file). Under SLURM the same
mapping goes into srun's environment (`--export=ALL` hands it to the tasks through slurmd, not argv). A secret
that must stay a file (0600) can be written into `EnvFile.folder`, the per-launch 0700 folder, and its path ride here.

`squad/glue finetune` on several nodes goes through DeepSpeed's runner, which puts every line of its env file and
every MLFLOW*/PYTHON*/UCX*/MV2*/NCCL* variable on its pdsh command line (and logs it). `python -m
pretrain.launch.node_env ship` (launch.sh) ships those here instead and prints what the runner needs: the names to
unset from its environment, and a rank command prefix (EXEC_WITH_ENV, for its --no_python) that sources the file on
the node and then becomes the rank.

Standard library only, as nodes.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from pretrain.distributed.cluster import ClusterError, pdsh_quote, remote_quote, shell_assignments
from pretrain.errors import exit_on_error

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
FOLDER_PREFIX = ".bert-ds-env-"
FILE_NAME = "env"
NOT_SHARED_STATUS = 2  # a node that cannot source the file ends with this (nodes.py: "ended by itself")
# What DeepSpeed's pdsh runner copies from its environment onto its command line (its EXPORT_ENVS, and NCCL for CUDA).
RUNNER_EXPORTED = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
KEPT_BY_THE_RUNNER = ("PYTHONSAFEPATH",)  # the runner itself must keep it; "1" is no secret
# `bash -c EXEC_WITH_ENV bash FILE COMMAND...`: source_command's checks and read, then become COMMAND.
EXEC_WITH_ENV = ('f=$1; shift; { [ -O /dev/fd/3 ] && [ -O "${f%/*}" ] && [ ! -L "${f%/*}" ] && set -a && '
                 '. /dev/fd/3 && set +a; } 3<"$f" || { echo "error: the environment file $f of this launch is missing '
                 'on this node or not yours: the working folder must be on a file system every node shares, at the '
                 f'same path" >&2; exit {NOT_SHARED_STATUS}; }}; exec "$@"')


def parse_env_lines(lines: Iterable[str], source: str) -> dict[str, str]:
    """NAME -> VALUE of `lines` in DeepSpeed's env-file form (NAME=VALUE, the value as written to the line's end; blank
    lines and "#" comments skip; spaces around NAME are dropped, as DeepSpeed drops them); the last of a name wins.
    A line that is not NAME=VALUE with a shell variable name is a ClusterError naming `source`, the line and the
    name, never a value (the file holds tokens)."""
    values: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, equals, value = line.partition("=")
        if not equals:
            raise ClusterError(f"{source} line {number}: expected NAME=VALUE, got a line without '='")
        if not ENV_NAME.fullmatch(name.strip()):
            raise ClusterError(f"{source} line {number}: '{name.strip()[:60]}' is not a variable name (letters, "
                               "digits and _, not a digit first)")
        values[name.strip()] = value
    return values


def read_env_file(path: str) -> dict[str, str]:
    """parse_env_lines of the file at `path`, byte for byte (a value that is not UTF-8 comes back as it was)."""
    try:
        text = Path(path).read_bytes().decode("utf-8", "surrogateescape")
    except OSError as err:
        raise ClusterError(f"env file '{path}' cannot be read: {err.strerror}") from None
    return parse_env_lines(text.split("\n"), f"env file '{path}'")


def shell_text(values: Mapping[str, str]) -> str:
    """The file's text: one `NAME='value'` assignment a line, safe to source (names checked, values shlex-quoted;
    a value with a newline stays one quoted word)."""
    for name in values:
        if not ENV_NAME.fullmatch(name):
            raise ClusterError(f"not a variable name: '{name}'")
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items())


def source_command(path: str, folder: str) -> str:
    """The part of the remote command that exports every variable of `path` (in `folder`) on the node, or ends its
    shell with NOT_SHARED_STATUS and one line when the file is missing there or is not the user's own.

    `{ ...; } 3<FILE` opens the file once; `[ -O /dev/fd/3 ]` checks that open file's owner (bash checks the
    descriptor itself; dash and zsh stat it through /proc: the same open file); `. /dev/fd/3` reads that same file;
    `set -a` exports what it assigns. Paths are quoted for the node's shell and for pdsh (remote_quote)."""
    message = (f"error: the launch's environment file {path} is missing on this node or not yours: the working "
               "folder must be on a file system every node shares, at the same path")
    where = remote_quote(folder)
    return (f"{{ [ -O /dev/fd/3 ] && [ -O {where} ] && [ ! -L {where} ] && set -a && . /dev/fd/3 && set +a; }} "
            f"3<{remote_quote(path)} || {{ echo {remote_quote(message)} >&2; exit {NOT_SHARED_STATUS}; }};")


class EnvFile:
    """The per-launch folder (0700) and its env file (0600) in `parent`; `write` makes both, `remove` deletes both."""

    def __init__(self, values: Mapping[str, str], parent: Path) -> None:
        self.values, self.parent = dict(values), parent
        self.folder: Path | None = None

    @property
    def path(self) -> Path:
        """The env file; before `write`, a placeholder of its form (what --dry-run shows)."""
        return (self.folder or self.parent / f"{FOLDER_PREFIX}XXXXXXXX") / FILE_NAME

    def write(self) -> Path:
        try:
            self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=self.parent))
        except OSError as err:
            raise ClusterError(f"cannot create the launch's environment folder in the working folder {self.parent} "
                               f"({err.strerror}): start launch.sh from a folder you can write, on the file system "
                               "the nodes share") from None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        descriptor = os.open(self.path, flags, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8", errors="surrogateescape") as out:
            out.write(shell_text(self.values))
        return self.path

    def remove(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def runner_shipment(ds_env: Mapping[str, str], env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """What DeepSpeed's runner must not carry: (the values to ship, the names to unset from its environment). The
    env file's lines (`ds_env`) win over the environment's, as they do in DeepSpeed."""
    taken = [name for name in env if name.startswith(RUNNER_EXPORTED) and name not in KEPT_BY_THE_RUNNER]
    return {**{name: env[name] for name in taken}, **ds_env}, taken


def main(argv: Sequence[str] | None = None) -> int:
    """`ship`: the finetune runner's shipment (runner_shipment) written to the working folder, and shell assignments
    for launch.sh: NODE_ENV_DIR (to remove at exit; empty under --dry-run), RUNNER_UNSET (names), NODE_ENV_EXEC (the
    pdsh-quoted rank command prefix: bash -c EXEC_WITH_ENV bash FILE PYTHON -u -m)."""
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.node_env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prog", default="pretrain.launch.node_env", help="name to prefix errors with (the caller)")
    commands = parser.add_subparsers(dest="command", required=True)
    ship = commands.add_parser("ship", help="DeepSpeed runner's variables to a 0600 file, as shell assignments")
    ship.add_argument("--env-file", default="", help="launch.sh's DS_ENV_FILE (NAME=VALUE lines)")
    ship.add_argument("--python", required=True, help="the ranks' interpreter")
    ship.add_argument("--dry-run", action="store_true", help="write nothing; show where the file would be")
    args = parser.parse_args(argv)

    def shipped() -> None:
        values, unset = runner_shipment(read_env_file(args.env_file) if args.env_file else {}, os.environ)
        env_file = EnvFile(values, Path.cwd())
        if not args.dry_run:
            env_file.write()
        words = ["bash", "-c", EXEC_WITH_ENV, "bash", str(env_file.path), args.python, "-u", "-m"]
        sys.stdout.write(shell_assignments({"NODE_ENV_DIR": str(env_file.folder or ""), "RUNNER_UNSET": unset,
                                            "NODE_ENV_EXEC": [pdsh_quote(word) for word in words]}))

    return exit_on_error(shipped, ClusterError, prefix=f"{args.prog}: error: ")


if __name__ == "__main__":
    sys.exit(main())
