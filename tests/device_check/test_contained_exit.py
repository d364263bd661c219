"""A contained self-test's child is never left behind (pretrain/device_check/contained.py): one that gives its verdict and
then does not end (a thread that never returns stands in for a driver stuck at teardown) is sent SIGKILL after a
bounded wait and is gone when `in_child` returns, its verdict kept. Before, a child alive 30 s after its verdict
was left running (with its CUDA context, on a GPU), and the kill path's join had no bound. A real spawned child."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from pretrain.device_check.contained import in_child
from pretrain.device_check.verdict import SelfTestResult

CPU = torch.device("cpu")


def answers_then_lingers(pid_file: str) -> SelfTestResult:
    """A passed verdict, from a process that then cannot exit: a non-daemon thread sleeps for an hour."""
    Path(pid_file).write_text(str(os.getpid()))
    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    return SelfTestResult(True, "cpu fp32")


def test_a_child_that_lingers_after_its_verdict_is_killed_and_its_verdict_kept(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    verdict = in_child(answers_then_lingers, str(pid_file), where="cpu fp32", exit_wait_s=1.0)
    assert verdict.passed and verdict.where == "cpu fp32"
    with pytest.raises(ProcessLookupError):  # gone (killed and reaped), not left running
        os.kill(int(pid_file.read_text()), 0)
