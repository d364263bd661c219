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

Standard library only, as nodes.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from pretrain.distributed.cluster import ClusterError, remote_quote

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
FOLDER_PREFIX = ".bert-ds-env-"
FILE_NAME = "env"
NOT_SHARED_STATUS = 2  # a node that cannot source the file ends with this (nodes.py: "ended by itself")


def parse_env_lines(lines: Iterable[str], source: str) -> dict[str, str]:
    """NAME -> VALUE of `lines` in DeepSpeed's env-file form (NAME=VALUE, the value as written to the line's end; blank
    lines and "#" comments skip; spaces around NAME are dropped, as DeepSpeed drops them); the last of a name wins.
    A line that is not NAME=VALUE with a shell variable name is a ClusterError naming `source` and the line."""
    values: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, equals, value = line.partition("=")
        if not equals or not ENV_NAME.fullmatch(name.strip()):
            raise ClusterError(f"{source} line {number}: expected NAME=VALUE with NAME of letters, digits and _ "
                               f"(not a digit first), got '{line.strip()[:80]}'")
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
