"""The device self-tests run where a device fault cannot reach the training context: a short-lived child process.

A kernel that faults on a GPU (an illegal memory access, a launch failure) leaves a sticky error in the CUDA
context of the process that ran it: every later CUDA call of that process fails, the eager fallback included, so
a self-test run in the rank itself could not fall back from what it found. Run in a spawned child (a fresh
interpreter and CUDA context, on the same device), the worst a fault does is end the child: its verdict is then a
failed test (the child's end in words), the rank's own context untouched, and `auto` falls back as for any failed
test. The child costs an interpreter's start and torch's import (seconds), so a host runs both stages in one child
and only when it has no verdict in the run folder (pretrain/device_check/host_check.py), and only CUDA devices get
one; on the CPU there is no context to poison and the test runs in the rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from pretrain.device_check.run_shape import RunShape
from pretrain.device_check.verdict import SelfTestResult
from pretrain.distributed.lifetime import die_with_parent

# device, precision, head size, seq_len, and the run's shapes (None: the test's own)
SelfTest = Callable[[torch.device, str, int, int, RunShape | None], SelfTestResult]

CHILD_LIMIT_S = 600.0  # a child with no verdict by then is killed: its test failed (the rank's start-up timer is longer)
EXIT_WAIT_S = 30.0  # how long a child may take to end after its verdict, or after SIGKILL


def _child(conn: Connection, stages: Callable[..., Iterator[SelfTestResult]], args: tuple[Any, ...],
           wheres: list[str]) -> None:
    """Each stage's verdict as it comes, then None (no more): a later stage's fault keeps the earlier verdicts. An
    error outside a test's own guard (the device cannot be opened at all) is the current stage's failed verdict."""
    die_with_parent(signal.SIGKILL)  # a rank killed meanwhile leaves no test running on its GPU
    sent = 0
    try:
        for result in stages(*args):
            conn.send(result)
            sent += 1
    except Exception as error:  # noqa: BLE001 - e.g. "all CUDA-capable devices are busy or unavailable"
        first = (str(error).strip().splitlines() or [""])[0][:200]
        conn.send(SelfTestResult(False, wheres[min(sent, len(wheres) - 1)],
                                 failure=f"{type(error).__name__}: {first}"))
    with contextlib.suppress(OSError):  # the parent may have read every verdict it waits for, and gone
        conn.send(None)
    conn.close()


def one_stage(test: Callable[..., SelfTestResult], *args: Any) -> Iterator[SelfTestResult]:
    """`test(*args)` as a child's only stage (module-level: the child imports it by name)."""
    yield test(*args)


def in_child(test: Callable[..., SelfTestResult], *args: Any, where: str = "", limit_s: float = CHILD_LIMIT_S,
             exit_wait_s: float = EXIT_WAIT_S) -> SelfTestResult:
    """`test(*args)` in a spawned child process; its verdict, or a failed one that says how the child ended (a
    signal, a status, no verdict within `limit_s`). `where` names the device and dtype in that verdict. The child
    is gone when this returns, or was sent SIGKILL and waited for `exit_wait_s` (`stop`)."""
    return stages_in_child(one_stage, (test, *args), [where], limit_s, exit_wait_s)[0]


def stages_in_child(stages: Callable[..., Iterator[SelfTestResult]], args: tuple[Any, ...], wheres: list[str],
                    limit_s: float = CHILD_LIMIT_S, exit_wait_s: float = EXIT_WAIT_S) -> list[SelfTestResult]:
    """The verdicts `stages(*args)` yields, all in one spawned child (one interpreter's start for every stage): at
    most one per entry of `wheres` (each stage's device and dtype), fewer when the stages stop early (a later stage
    that needs an earlier one's pass). A stage with no verdict within `limit_s` of the last one, or a child that
    ends before it, gives that stage a failed verdict saying how (in_child's words); the stages after it none. The
    child is gone when this returns, or was sent SIGKILL and waited for `exit_wait_s` (`stop`)."""
    context = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, stages, args, wheres), daemon=True)
    child.start()
    send.close()
    results: list[SelfTestResult] = []
    try:
        while len(results) < len(wheres) and receive.poll(limit_s):  # a verdict, or the end of the pipe
            try:
                got = receive.recv()
            except EOFError:
                child.join(timeout=exit_wait_s)
                break
            if got is None:  # the stages are done
                return results
            results.append(got)
        if len(results) == len(wheres):
            return results
        if child.is_alive():
            stop(child, exit_wait_s)
            failure = f"no verdict in {limit_s:g} s: its process was killed"
        else:
            failure = f"its process {ended(child.exitcode)} (a device fault, kept out of the rank's own context)"
        return [*results, SelfTestResult(False, wheres[len(results)], failure=failure)]
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
