"""A rank's life bound to its job: it dies with the process that started it, and one job at a time writes a
run folder.

Standard library only. Two pieces (launch.sh's own watchdog, which stops a job whose launch.sh vanished, is
pretrain/launch/watchdog.py):

- `die_with_parent`: PR_SET_PDEATHSIG (Linux prctl), so a rank or a demo child gets SIGTERM when the
  process that started it dies, even of SIGKILL; `tie_to_launcher` picks the signal by the launcher. The kernel sends it when the parent *thread* exits,
  so children are started from a thread that lives as long as they do (the main thread here).
- `hold_run_folder`: an exclusive flock on RUN_DIR/.job.lock held by the job's rank 0 for the
  process's life, so a second job refuses a run folder a live job still writes into. The kernel
  drops a flock when its holder dies, so the lock is never stale. `hold_checkpoint_folder` does the same
  for a `checkpoint.dir` (its lock file named by pretrain/checkpointing/layout.py): two runs that share
  one would resume from and prune each other's checkpoints. Which run a checkpoint folder belongs to between
  jobs is pretrain/checkpointing/ownership.py's record.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import sys
from pathlib import Path

from pretrain.run_folder import JOB_LOCK

PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies. False where unsupported.

    Also survives exec, so `preexec_fn=die_with_parent` gives a child (a shell script included) the same.
    If the parent is already gone when this runs (we were reparented), the signal is sent at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # it died between the two reads
        os.kill(os.getpid(), signum)
    return True


# The launchers that start every rank from their main thread and live as long as the ranks (not slurmstepd, whose
# threads come and go), by a word of their command line, and the signal a rank gets when its launcher dies:
# - our elastic agent (pretrain/launch/agent.py): SIGKILL. The agent's death is a node fault, never a stop: a SIGTERM
#   would be read as the user's stop request (a checkpoint, exit 0: the job "done" before its last step), and that
#   save would fail without the agent's timer server. Killed at once, the rank leaves its peers as a dead machine
#   does, so the job goes on without the node (--nodes MIN:MAX) or stops with the lost node's line.
# - DeepSpeed's launcher and torchrun (fine-tunes, tests): SIGTERM, a stop; the rank checkpoints.
PARENT_DEATH_SIGNALS = {b"pretrain.launch.agent": signal.SIGKILL, b"deepspeed.launcher.launch": signal.SIGTERM,
                        b"torch.distributed.run": signal.SIGTERM}


def parent_death_signal() -> int | None:
    """The signal this process should get when its launcher dies (PARENT_DEATH_SIGNALS); None: no such launcher."""
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return next((signum for word, signum in PARENT_DEATH_SIGNALS.items() if word in parent), None)


def tie_to_launcher() -> int | None:
    """The rank's first act (pretrain/train.py, before its heavy imports): die with the launcher that started it
    (PARENT_DEATH_SIGNALS), so a rank still importing torch when its agent dies goes with it. Returns the signal, or
    None under no known launcher."""
    signum = parent_death_signal()
    if signum is not None:
        die_with_parent(signum)
    return signum


# ---------------------------------------------------------------------- run folder lock
class RunFolderBusyError(RuntimeError):
    """Another live process holds the run folder's lock."""


_held: dict[Path, int] = {}  # locked folder -> the descriptor holding its flock in this process
_tied: dict[Path, list[Path]] = {}  # run folder -> the checkpoint folders locked for it (released with it)


def _hold(folder: Path, lock_name: str, key: str) -> bool:
    """Take FOLDER/lock_name for this process's life (again in the same process: a no-op). True when held.

    Raises RunFolderBusyError naming the holder. On a file system without flock (some Lustre mounts) it
    returns False without a lock: the lock is a second protection, the watchdog the first."""
    if folder in _held:
        return True
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / lock_name
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunFolderBusyError(
            f"{key} {folder} is in use by a live job ({holder}; lock {path}): stop that job, or use another "
            f"{key}") from None
    except OSError:  # no flock on this file system
        os.close(fd)
        return False
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held[folder] = fd
    return True


def hold_run_folder(run_dir: Path) -> None:
    """Take RUN_DIR/.job.lock for this process's life (again in the same process: a no-op); see `_hold`."""
    _hold(Path(run_dir).resolve(), JOB_LOCK, "run.dir")


def hold_checkpoint_folder(checkpoint_dir: Path, run_dir: Path, lock_name: str) -> None:
    """Take CHECKPOINT_DIR/lock_name for this process's life, released with `run_dir`'s lock (another file than
    the run folder's: a checkpoint.dir that is the run folder itself must not lock against itself); see `_hold`."""
    folder = Path(checkpoint_dir).resolve()
    if _hold(folder, lock_name, "checkpoint.dir"):
        _tied.setdefault(Path(run_dir).resolve(), []).append(folder)


def release_folder(folder: Path) -> None:
    """Drop this process's lock on one folder (a refused claim)."""
    fd = _held.pop(Path(folder).resolve(), None)
    if fd is not None:
        os.close(fd)


def release_run_folder(run_dir: Path) -> None:
    """Drop this process's lock on `run_dir` and on the checkpoint folders held for it (in-process callers that
    train the same folder again)."""
    run_dir = Path(run_dir).resolve()
    for folder in [run_dir, *_tied.pop(run_dir, [])]:
        release_folder(folder)
