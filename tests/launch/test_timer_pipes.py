"""The agent's timer pipe lives in a 0700 folder of its own, and the cleanup of leftovers removes only the folders of
agents it can see are gone (pretrain/launch/timer_pipes.py).

Real pipes and folders in a temporary folder, real processes (a child that has exited: a pid that is gone), and the
real timer server (pretrain/launch/hang_watch.py) started and stopped; no ranks. Another pid namespace or host
cannot be entered without privileges, so their folders are named as the agents there would name them: this host's
name with another namespace's inode, another host's name with ours.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from pretrain.launch.hang_watch import HangWatch, Limits
from pretrain.launch.timer_pipes import (
    FOLDER_PREFIX,
    PIPE,
    make_pipe_path,
    pid_namespace,
    remove_stale_timer_pipes,
    this_host,
)


def test_the_pipe_lives_in_a_folder_only_its_user_can_enter_and_goes_with_its_server(tmp_path: Path) -> None:
    path = Path(make_pipe_path(str(tmp_path)))
    watch = HangWatch(str(path), Limits(hang_s=60.0, startup_s=60.0))
    watch.start()
    try:
        assert stat.S_ISFIFO(path.stat().st_mode) and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert path.parent.name.startswith(f"{FOLDER_PREFIX}{this_host()}-{pid_namespace()}-{os.getpid()}-")
    finally:
        watch.stop()
    assert list(tmp_path.iterdir()) == []  # the pipe (torch) and its folder (ours)


def folder(parent: Path, host: str, namespace: str, pid: int, suffix: str) -> str:
    """A pipe folder as an agent of `host`, pid namespace `namespace` and pid `pid` makes it (mkdtemp's 8 chars)."""
    made = parent / f"{FOLDER_PREFIX}{host}-{namespace}-{pid}-{suffix}"
    made.mkdir(mode=0o700)
    os.mkfifo(made / PIPE)
    return made.name


def test_the_cleanup_leaves_every_pipe_whose_holder_it_cannot_see(tmp_path: Path) -> None:
    """Removed: an agent of this host and pid namespace that is gone. Left: a live one; a gone pid of another pid
    namespace (a container on this host) or of another host; the older form that recorded the pid alone (today a
    container's agent would lose its live pipe to it); a link; anything else."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host, namespace = this_host(), pid_namespace()
    assert namespace != "0", "this machine hides /proc/self/ns/pid: the cleanup removes nothing here"
    stale = folder(tmp_path, host, namespace, gone.pid, "stale___")
    left = [folder(tmp_path, host, namespace, os.getpid(), "live____"),
            folder(tmp_path, host, str(int(namespace) + 1), gone.pid, "othernss"),
            folder(tmp_path, f"not-{host}", namespace, gone.pid, "otherhst"),
            folder(tmp_path, host, "0", gone.pid, "unknown_")]
    older = f"bert-ds-timers-{gone.pid}-{'a' * 32}"  # the form before the folders: no host, no namespace
    os.mkfifo(tmp_path / older)
    link = f"{FOLDER_PREFIX}{host}-{namespace}-{gone.pid}-linked__"
    (tmp_path / link).symlink_to(tmp_path / left[0])
    (tmp_path / "notes.txt").write_text("x")
    assert remove_stale_timer_pipes(str(tmp_path)) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*left, older, link, "notes.txt"])
    assert all((tmp_path / name / PIPE).exists() for name in left)
