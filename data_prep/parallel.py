"""Ordered, bounded parallel map: results come back in input order whatever the worker count.

Determinism does not rest on this order (every task is a pure function of its inputs and
writes its own file), but the order keeps progress and statistics reproducible, and the bound
keeps memory flat while a 20 GB dump is streamed into the workers (Pool.imap would read the
whole input ahead).

A worker killed in the middle of a task (on a shared node, the out-of-memory killer's SIGKILL picks the largest
process, often a worker) ends the build with one line instead of hanging it: `multiprocessing.Pool` replaces the
dead worker but waits forever for the task it held. So each result is awaited a second at a time, and before
each wait every worker the pool has started is looked at: a Pool worker never exits on its own while the pool is
open, so one that has exited was killed. The Pool itself stays: its workers read their tasks from a pipe and exit
when the build does, however the build ends (concurrent.futures' workers were measured to outlive a SIGKILLed
build).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from data_prep.build_errors import BuildError

WATCH_SECONDS = 1.0  # how long a wait for a result lasts before the workers are looked at

T = TypeVar("T")
R = TypeVar("R")


def _init_worker() -> None:
    # Each worker is one core: keep the tokenizers' Rust thread pool from oversubscribing it.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


class RecordingPool(multiprocessing.pool.Pool):
    """A Pool that keeps every worker process it starts, the first ones and each replacement: the pool forgets a
    dead worker within milliseconds (it waits on the workers' sentinels), so a death is only seen reliably here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.started: list[multiprocessing.process.BaseProcess] = []
        super().__init__(*args, **kwargs)

    def Process(self, ctx: Any, *args: Any, **kwargs: Any) -> multiprocessing.process.BaseProcess:  # noqa: N802
        """The pool's own hook for making a worker (a static method there), called for each one it starts."""
        worker = ctx.Process(*args, **kwargs)
        self.started.append(worker)
        return worker


class Workers:
    """A process pool (spawned, so no forked Rust/thread state) or, for one worker, in-process."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool = None
        if count > 1:
            self._pool = RecordingPool(count, initializer=_init_worker, context=multiprocessing.get_context("spawn"))

    def map(self, fn: Callable[[T], R], items: Iterable[T], max_in_flight: int | None = None) -> Iterator[R]:
        if self._pool is None:
            for item in items:
                yield fn(item)
            return
        bound = max_in_flight or 2 * self.count
        pending: deque[Any] = deque()
        for item in items:
            pending.append(self._pool.apply_async(fn, (item,)))
            if len(pending) >= bound:
                yield self._result(pending.popleft())
        while pending:
            yield self._result(pending.popleft())

    def _result(self, pending: Any) -> Any:
        while True:
            self._look_at_workers()  # also when the result is there: a death is told even if no task was lost
            try:
                return pending.get(timeout=WATCH_SECONDS)
            except multiprocessing.TimeoutError:
                continue

    def _look_at_workers(self) -> None:
        """BuildError when a worker the pool started has exited."""
        dead = [worker for worker in self._pool.started if worker.exitcode is not None]
        if dead:
            self.terminate()
            raise BuildError(f"a data-prep worker process (pid {dead[0].pid}) {exit_cause(dead[0].exitcode)} in the "
                             "middle of the build (the out-of-memory killer?); the other workers were stopped and the "
                             "finished tasks are kept: run the same command again to resume")

    def terminate(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.terminate()
        self.close()


def exit_cause(exitcode: int) -> str:
    """'was killed by SIGKILL' or 'exited with status N' (a multiprocessing exitcode: minus the signal's number)."""
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"
