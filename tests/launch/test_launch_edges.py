"""The launcher's smaller edges: every node asked for the store at once (pretrain/launch/store_reach.py), the
transport's wait bounded once every agent has ended (processes.wait_bounded), and a full disk met at a restart given
the free-space line, by the rank's verdict (faults.judge) and by the agent's own end (agent_end.run), never a
traceback or "a bug"."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from pretrain.distributed.cluster import ClusterError
from pretrain.launch.agent_end import run
from pretrain.launch.faults import FaultContext, FaultHistory, RankFailure, judge
from pretrain.launch.processes import wait_bounded
from pretrain.launch.store_reach import before_start


def test_every_node_is_asked_at_once_and_too_few_reaching_the_store_names_them() -> None:
    """Each ask waits until all four have been asked (a barrier): asked one after another, the first would wait in
    vain. n2 and n4 are down."""
    barrier = threading.Barrier(4, timeout=30)

    def ask(node: str, store: tuple[str, int]) -> str | None:
        assert store == ("10.0.0.1", 29500)
        barrier.wait()
        return "ssh: connect to host port 22: No route to host" if node in ("n2", "n4") else None

    hosts = ["n1", "n2", "n3", "n4"]
    left, warnings = before_start(hosts, 2, "10.0.0.1:29500", ask, serving=False)
    assert left == ["n1", "n3"]
    assert warnings == ["warning: node(s) left out, they cannot reach the rendezvous store at 10.0.0.1:29500: n2 "
                        "(ssh: connect to host port 22: No route to host); n4 (ssh: connect to host port 22: No route "
                        "to host); starting on the 2 that can (--nodes 2:4)"]
    barrier.reset()
    with pytest.raises(ClusterError, match=r"^2 of 4 node\(s\) cannot reach .*: n2 \(.*\); n4 \(.*\); 2 can, the job "
                                           r"needs 3\. A machine down"):
        before_start(hosts, 3, "10.0.0.1:29500", ask, serving=False)
    barrier.reset()
    assert before_start(["n1", "n3"], 2, "10.0.0.1:29500", lambda node, store: None, serving=False) == (["n1", "n3"],
                                                                                                       [])


def test_the_transports_wait_is_bounded_once_every_agent_has_ended() -> None:
    """pdsh stands here as a process that never ends by itself (a rank left behind keeps its ssh channel open):
    ended once every agent has said it ended and the grace ran out; one that ends by itself gives its status."""
    held = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], text=True)
    assert wait_bounded(held, lambda: True, 0.2) is None
    assert held.returncode == -9
    quick = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True)
    assert wait_bounded(quick, lambda: False, 0.2) == 3


def test_a_rank_that_finds_the_disk_full_at_a_restart_gets_the_free_space_line_not_a_bug(tmp_path: Path) -> None:
    """Rank 0's start-up write fails with ENOSPC (its traceback in its log) twice with no newer checkpoint. Before:
    'restarting', then 'the same failure as the last one ... a bug'. Now the first verdict says to free space."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "latest").write_text("phase1-step0000010\n")
    log = tmp_path / "rank-0.log"
    log.write_text("Traceback (most recent call last):\n  File \"pretrain/train.py\", line 293, in train_plan\n"
                   "OSError: [Errno 28] No space left on device: 'RUN/config.resolved.json'\n")
    context = FaultContext("bert-d", 3, tmp_path, checkpoints, "./launch.sh pretrain --config run.json")
    record = judge(RankFailure(0, "n1", 1, "phase1 set-up", log), 1, context, FaultHistory(tmp_path / "faults"))
    assert not record.restarts and record.exit_status == 1
    assert "its file system is full or its quota spent (OSError: [Errno 28] No space left on device" in record.line
    assert "free space there, then resume with: ./launch.sh pretrain --config run.json" in record.line
    assert "a bug" not in record.line


class Node:
    host = "n1"


class FullDiskAgent:
    """What agent_end.run reads of the agent, whose run meets ENOSPC where torch makes the attempt's log folder."""

    node = Node()
    last_word = ""

    class judging:
        class context:
            resume_command = "./launch.sh pretrain --config run.json"

    class watch:
        @staticmethod
        def stop() -> None:
            pass

    def run(self) -> Any:
        os.mkdir("/dev/null/attempt-1")  # a real OSError (ENOTDIR) first: not a space error, raised as ever

    def get_worker_group(self) -> Any:
        raise RuntimeError("no group: nothing to close")


def test_an_agent_whose_restart_meets_a_full_disk_ends_with_the_free_space_line(
        capfd: pytest.CaptureFixture[str]) -> None:
    agent = FullDiskAgent()
    with pytest.raises(NotADirectoryError):
        run(agent)

    def full(_self: Any = None) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "RUN/logs/launch/attempt-1")

    agent.run = full  # type: ignore[method-assign]
    assert run(agent) == 1
    (line,) = capfd.readouterr().err.splitlines()
    assert line == ("launch.sh: error: host n1: the run folder's file system is full or its quota spent ([Errno 28] "
                    "No space left on device: 'RUN/logs/launch/attempt-1'); free space there, then resume with: "
                    "./launch.sh pretrain --config run.json")
    assert agent.last_word == line.removeprefix("launch.sh: ")
