"""Where an agent's timer pipe lives, and which pipes left behind by agents that are gone may be removed.

The ranks tell the agent's timer server (pretrain/launch/hang_watch.py) their timers over a named pipe, and the
server carries out what they ask: kill pid P with signal S when its timer runs out. torch makes the pipe with the
default mode (0666 less the umask) where it is told; in the shared temporary folder, anyone the mode lets in could
send requests. So each agent's pipe lives in a folder of its own made with mkdtemp (0700, never an existing one):
TMPDIR/bert-ds-timers-HOST-PIDNS-PID-XXXXXXXX/timers.

The folder's name records its holder: the host, the pid namespace (the inode of /proc/self/ns/pid) and the pid of
the agent. An agent killed by SIGKILL leaves its folder behind; the next agent removes the folders whose holder it
can see is gone: same host, same pid namespace, the pid not running, and the folder its user's. A folder of another
host (a temporary folder shared between machines), of another pid namespace (a container on the same host, whose
processes this one cannot see), of an unknown namespace, or in the older form that recorded the pid alone, is
treated as held and left: a stale one costs an empty folder, a live one removed costs a job its hang timers.

Standard library only (and /proc through pretrain/launch/processes.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import tempfile
from pathlib import Path

from pretrain.launch.processes import running

FOLDER_PREFIX = "bert-ds-timers-"
PIPE = "timers"  # the pipe's name inside its folder
UNKNOWN_NAMESPACE = "0"  # /proc/self/ns/pid unreadable: such folders are never removed (nobody can tell whose)
_FOLDER = re.compile(FOLDER_PREFIX + r"(?P<host>[A-Za-z0-9._-]+)-(?P<ns>[0-9]+)-(?P<pid>[0-9]+)-[a-z0-9_]{8}")


def pid_namespace() -> str:
    """The inode of this process's pid namespace ("pid:[4026531836]" -> "4026531836"), UNKNOWN_NAMESPACE if unread."""
    try:
        found = re.fullmatch(r"pid:\[([0-9]+)\]", os.readlink("/proc/self/ns/pid"))
    except OSError:
        return UNKNOWN_NAMESPACE
    return found[1] if found else UNKNOWN_NAMESPACE


def this_host() -> str:
    """This machine's name in a folder name: characters other than letters, digits, '.', '_' and '-' become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "_"


def _own_prefix() -> str:
    return f"{FOLDER_PREFIX}{this_host()}-{pid_namespace()}-{os.getpid()}-"


def make_pipe_path(parent: str) -> str:
    """The path of this agent's pipe: in a fresh 0700 folder inside `parent`, named after its holder."""
    return os.path.join(tempfile.mkdtemp(prefix=_own_prefix(), dir=parent), PIPE)


def remove_pipe_folder(pipe_path: str) -> None:
    """The pipe's folder once its server has stopped (torch removes the pipe itself), when make_pipe_path made it
    for this process; nothing else in it is removed, and no other folder."""
    folder = os.path.dirname(pipe_path)
    if os.path.basename(folder).startswith(_own_prefix()):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def remove_stale_timer_pipes(parent: str) -> list[str]:
    """Remove the pipe folders in `parent` of agents of this host and pid namespace that are gone (their pid not
    running), this user's only; returns their names. Any other is left (module docstring): a pid reused by another
    process keeps its folder too (a harmless leftover, never a live agent's pipe lost)."""
    host, namespace = this_host(), pid_namespace()
    removed = []
    for name in sorted(os.listdir(parent)):
        found = _FOLDER.fullmatch(name)
        if not found or namespace == UNKNOWN_NAMESPACE or (found["host"], found["ns"]) != (host, namespace):
            continue
        folder = Path(parent) / name
        with contextlib.suppress(OSError):
            facts = folder.lstat()  # not followed: a link is nobody's folder
            if stat.S_ISDIR(facts.st_mode) and facts.st_uid == os.geteuid() and not running(int(found["pid"])):
                (folder / PIPE).unlink(missing_ok=True)
                folder.rmdir()  # fails (and the folder stays) if anything else is in it
                removed.append(name)
    return removed
