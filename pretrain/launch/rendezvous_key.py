"""The per-job secret that signs the agents' rendezvous state (pretrain/launch/signed_rendezvous.py says why).

One machine: the agent draws it itself (`draw`), nobody else needs it. Several nodes: pretrain/launch/nodes.py
draws it before any agent starts and writes it (`write`) into a folder of its own in the launch's working folder,
the one folder every node's agent starts in (pdsh's `cd`, srun's inherited working folder), so the nodes read it
over the shared file system: the folder is made 0700 (mkdtemp, never an existing one), the file 0600 (O_EXCL). Each
agent is handed the file's path (`handed_to`: `--rdzv-key-file PATH`, relative to the working folder, so a path of
shell-safe characters, and never the secret, is on a command line) and reads it with `read`, which refuses a file that is a link, not its user's, or readable by others, in one line naming it.
nodes.py removes the folder at the job's end (`handed_to`, `remove`).

Standard library only: nodes.py imports it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pretrain.errors import UserError

KEY_BYTES = 32  # HMAC-SHA256's block-sized key
KEY_FOLDER_PREFIX = ".bert-ds-rendezvous-"  # the folder nodes.py makes in the working folder (mkdtemp adds 8 chars)
KEY_FILE = "key"  # inside it: the secret as hex text, one line


class RendezvousKeyError(UserError):
    """The rendezvous key file cannot be trusted or read; the message names it."""


def draw() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def write(folder: Path) -> tuple[Path, bytes]:
    """A fresh 0700 folder inside `folder` holding a fresh 0600 key file: (the file, the secret)."""
    secret = draw()
    made = Path(tempfile.mkdtemp(prefix=KEY_FOLDER_PREFIX, dir=folder))
    path = made / KEY_FILE
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as out:
        out.write(secret.hex() + "\n")
        out.flush()
        os.fsync(out.fileno())  # read next on other nodes, over the shared file system
    return path, secret


def read(path: Path) -> bytes:
    """The secret in `path`; RendezvousKeyError in one line naming the file when it is a link, not this user's,
    readable or writable by others, or not a key."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise RendezvousKeyError(f"the rendezvous key file {path} cannot be read ({err.strerror or err})") from err
    with os.fdopen(descriptor, "r", encoding="ascii", errors="replace") as key_file:
        facts = os.fstat(key_file.fileno())
        if not stat.S_ISREG(facts.st_mode) or facts.st_uid != os.geteuid() or facts.st_mode & 0o077:
            raise RendezvousKeyError(f"the rendezvous key file {path} is not a file of this user's that only it can "
                                     f"read (mode {stat.filemode(facts.st_mode)}, uid {facts.st_uid}): refused")
        text = key_file.read(4 * KEY_BYTES).strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != KEY_BYTES:
        raise RendezvousKeyError(f"the rendezvous key file {path} does not hold a key ({2 * KEY_BYTES} hex digits)")
    return secret


def remove(path: Path) -> None:
    """The key file and its folder, as `write` made them (nothing else in that folder is removed)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()


@contextlib.contextmanager
def handed_to(agent_args: list[str]) -> Iterator[Path]:
    """A fresh key in the working folder for the job's agents: `--rdzv-key-file PATH` appended to `agent_args`,
    the file and its folder removed when the job ends."""
    path, _ = write(Path.cwd())
    agent_args += ["--rdzv-key-file", os.path.relpath(path)]
    try:
        yield path
    finally:
        remove(path)
