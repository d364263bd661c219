"""The device self-tests run where a device fault cannot reach the training context: a short-lived child process.

A kernel that faults on a GPU (an illegal memory access, a launch failure) leaves a sticky error in the CUDA
context of the process that ran it: every later CUDA call of that process fails, the eager fallback included, so
a self-test run in the rank itself could not fall back from what it found. Run in a spawned child (a fresh
interpreter and CUDA context, on the same device), the worst a fault does is end the child: its verdict is then a
failed test (the child's end in words), the rank's own context untouched, and `auto` falls back as for any failed
test. The child costs an interpreter's start and torch's import (seconds, once per node and launch), so only
CUDA devices get one; on the CPU there is no context to poison and the test runs in the rank.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from pretrain.distributed.lifetime import die_with_parent
from pretrain.plan.run_shape import RunShape
from pretrain.plan.self_test import SelfTestResult

# device, precision, head size, seq_len, and the run's shapes (None: the test's own)
SelfTest = Callable[[torch.device, str, int, int, RunShape | None], SelfTestResult]

CHILD_LIMIT_S = 600.0  # a child with no verdict by then is killed: its test failed (the rank's start-up timer is longer)
EXIT_WAIT_S = 30.0  # how long a child may take to end after its verdict, or after SIGKILL


def _child(conn: Connection, test: Callable[..., SelfTestResult], args: tuple[Any, ...]) -> None:
    die_with_parent(signal.SIGKILL)  # a rank killed meanwhile leaves no test running on its GPU
    conn.send(test(*args))
    conn.close()


def in_child(test: Callable[..., SelfTestResult], *args: Any, where: str = "", limit_s: float = CHILD_LIMIT_S,
             exit_wait_s: float = EXIT_WAIT_S) -> SelfTestResult:
    """`test(*args)` in a spawned child process; its verdict, or a failed one that says how the child ended (a
    signal, a status, no verdict within `limit_s`). `where` names the device and dtype in that verdict. The child
    is gone when this returns, or was sent SIGKILL and waited for `exit_wait_s` (`stop`)."""
    context = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, test, args), daemon=True)
    child.start()
    send.close()
    try:
        if receive.poll(limit_s):  # a verdict, or the end of the pipe: the child is gone
            try:
                return receive.recv()
            except EOFError:
                child.join(timeout=exit_wait_s)
        if child.is_alive():
            stop(child, exit_wait_s)
            return SelfTestResult(False, where, failure=f"no verdict in {limit_s:g} s: its process was killed")
        return SelfTestResult(False, where, failure=f"its process {ended(child.exitcode)} (a device fault, kept out "
                                                    "of the rank's own context)")
    finally:
        receive.close()
        child.join(timeout=exit_wait_s)
        if child.is_alive():  # a verdict given, then stuck (in the driver's teardown): not left holding the device
            stop(child, exit_wait_s)


def stop(child: multiprocessing.process.BaseProcess, wait_s: float) -> None:
    """SIGKILL, then a bounded wait: a child stuck in the driver (uninterruptible) may outlive even SIGKILL for a
    while, and the rank must not wait on it past its own start-up timer (the kernel reaps it when it ends)."""
    child.kill()
    child.join(timeout=wait_s)


def contained(test: SelfTest, what: str = "") -> SelfTest:
    """`test` as the plan runs it: in a child process on a CUDA device (module docstring), in this one elsewhere.
    `what`: the test's name in a dead child's verdict (e.g. "compiled layer")."""
    def run(device: torch.device, precision: str, head_dim: int, seq_len: int,
            shape: RunShape | None = None) -> SelfTestResult:
        if device.type != "cuda":
            return test(device, precision, head_dim, seq_len, shape)
        where = f"{device} {precision}{f' {what}' if what else ''}"
        return in_child(test, device, precision, head_dim, seq_len, shape, where=where)

    return run


def ended(exitcode: int | None) -> str:
    """A child's end in words: 'died of SIGSEGV' or 'exited with status 1'."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"died of {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"died of signal {-exitcode}"
    return f"exited with status {exitcode}"
