"""A data-prep worker killed in the middle of a task (the out-of-memory killer's SIGKILL) ends the build with one
line, at once, and the same command resumes to the uninterrupted build's bytes; and a build killed itself leaves
no worker behind. Before, `multiprocessing.Pool` replaced the dead worker and the build waited forever for the
result it would never send (the first test hangs on it, caught by an alarm)."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from data_prep.__main__ import build_parser, config_from_args, main
from data_prep.build_errors import BuildError
from data_prep.parallel import Workers
from data_prep.shard_format.atomic_io import atomic_write_json
from tests.data_prep.input_shard_corpus import python_m, run, seed_folder, write_corpus
from tests.support.data_prep_fixtures import tree_digest
from tests.support.paths import REPO_ROOT

HANG_GUARD_S = 120  # the old pool never returned: a test that waits this long has found the hang again
DIED = (r"a data-prep worker process \(pid \d+\) was killed by SIGKILL in the middle of the build \(the out-of-memory "
        r"killer\?\); the other workers were stopped and the finished tasks are kept: run the same command again to "
        r"resume")


def square_but_die_at_two(item: int) -> int:
    """A task whose worker is killed in the middle of it, by the signal the kernel's OOM killer sends."""
    if item == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return item * item


def hung(signum: int, frame: object) -> None:
    raise TimeoutError(f"the pool waited {HANG_GUARD_S} s for a task whose worker was killed")


def test_a_worker_killed_in_its_task_ends_the_map_with_the_builds_error_not_a_hang() -> None:
    before = set(multiprocessing.active_children())
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_GUARD_S)
    try:
        with pytest.raises(BuildError) as raised, Workers(2) as workers:
            results = list(workers.map(square_but_die_at_two, range(6)))
            pytest.fail(f"every task came back, the killed one too: {results}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert re.fullmatch(DIED, str(raised.value)), raised.value
    assert set(multiprocessing.active_children()) <= before  # the other worker ended too, nothing left running


def test_an_error_of_a_task_is_its_own_and_the_pool_stops_at_once() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ZeroDivisionError), Workers(2) as workers:
        list(workers.map(divide_six_by, [3, 2, 0, 1, 6, 2]))
    assert set(multiprocessing.active_children()) <= before


def divide_six_by(item: int) -> float:
    return 6 / item


def worker_pids(build_pid: int) -> list[int]:
    """The build's spawned workers: its children running multiprocessing's spawn entry point."""
    children = Path(f"/proc/{build_pid}/task/{build_pid}/children")
    try:
        pids = [int(pid) for pid in children.read_text().split()]
    except OSError:
        return []
    found = []
    for pid in pids:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def start_and_kill(command: list[str], whom: str, sig: signal.Signals) -> tuple[subprocess.Popen[str], list[int]]:
    """Start a 2-worker build, send `sig` to its first worker or to the build as soon as the workers exist."""
    build = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (workers := worker_pids(build.pid)) and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    if workers:
        os.kill(workers[0] if whom == "worker" else build.pid, sig)
    return build, workers


def test_a_build_whose_worker_is_killed_says_so_in_one_line_and_the_same_command_resumes(tmp_path: Path) -> None:
    flags = write_corpus(tmp_path / "inputs", documents=120)
    identity = config_from_args(build_parser().parse_args(["build", *flags, "--out", "x"])).identity()
    atomic_write_json(tmp_path / "identity.json", identity)
    reference = tmp_path / "reference"
    seed_folder(reference, tmp_path / "identity.json")
    assert main(["build", *flags, "--out", str(reference), "--workers", "1"]) == 0

    for attempt in range(3):  # the kill races the build's end: a build that finished first is tried again
        out = tmp_path / f"killed-{attempt}"
        seed_folder(out, reference / "build_config.json")
        command = python_m("build", *flags, "--out", str(out), "--workers", "2")
        build, workers = start_and_kill(command, "worker", signal.SIGKILL)
        stdout, stderr = build.communicate(timeout=HANG_GUARD_S)
        if build.returncode != 0:
            break
    else:
        pytest.fail("the build finished before a worker could be killed, three times")
    assert build.returncode == 2 and re.fullmatch(f"error: {DIED}", stderr.strip().splitlines()[-1]), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not [pid for pid in workers if alive(pid)]  # the build ended its other workers

    again = run(command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert tree_digest(out) == tree_digest(reference)
    assert not list(out.rglob("*.tmp"))

    for sig in (signal.SIGTERM, signal.SIGKILL):  # the build killed itself: its workers end with it
        out = tmp_path / f"build-{sig.name}"
        seed_folder(out, reference / "build_config.json")
        build, workers = start_and_kill(python_m("build", *flags, "--out", str(out), "--workers", "2"), "build", sig)
        build.communicate(timeout=HANG_GUARD_S)
        deadline = time.monotonic() + 20
        while [pid for pid in workers if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers and not [pid for pid in workers if alive(pid)], (sig.name, workers)
