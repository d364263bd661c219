"""Ordered, bounded parallel map: results come back in input order whatever the worker count.

Determinism does not rest on this order (every task is a pure function of its inputs and
writes its own file), but the order keeps progress and statistics reproducible, and the bound
keeps memory flat while a 20 GB dump is streamed into the workers (Pool.imap would read the
whole input ahead).

A worker that dies in the middle of a task (the out-of-memory killer's SIGKILL, a signal sent to it alone) ends the
build with one line instead of hanging it: `multiprocessing.Pool` replaced the dead worker and waited forever for
the result that process never sent; `concurrent.futures` marks the pool broken and every waiting result raises.
The dead task wrote nothing final (a task's files and marker appear atomically), so the same command resumes.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from data_prep.build_errors import BuildError

T = TypeVar("T")
R = TypeVar("R")


def _init_worker() -> None:
    # Each worker is one core: keep the tokenizers' Rust thread pool from oversubscribing it.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


WORKER_DIED = ("a data-prep worker process died in the middle of a task (killed: by the out-of-memory killer, or a "
               "signal sent to it alone); the finished tasks are kept: run the same command again to resume (with "
               "fewer --workers if memory ran out)")


class Workers:
    """A process pool (spawned, so no forked Rust/thread state) or, for one worker, in-process."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool: ProcessPoolExecutor | None = None
        self._others: set[multiprocessing.process.BaseProcess] = set()
        if count > 1:
            self._others = set(multiprocessing.active_children())  # processes started before this pool's workers
            self._pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker)

    def map(self, fn: Callable[[T], R], items: Iterable[T], max_in_flight: int | None = None) -> Iterator[R]:
        if self._pool is None:
            for item in items:
                yield fn(item)
            return
        bound = max_in_flight or 2 * self.count
        pending: deque[Future[R]] = deque()
        try:
            for item in items:
                pending.append(self._submit(fn, item, pending))
                if len(pending) >= bound:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as err:  # from a result, or from a submit once the pool is broken
            raise BuildError(WORKER_DIED) from err

    def _submit(self, fn: Callable[[T], R], item: T, pending: deque[Future[R]]) -> Future[R]:
        assert self._pool is not None
        try:
            return self._pool.submit(fn, item)
        except OSError:
            # CPython 3.11: a pool that breaks while this submit spawns a worker closes the pipe it was handing the
            # worker ("handle is closed"); the tasks already submitted then end in BrokenProcessPool, which says so
            for future in pending:
                future.result()
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def terminate(self) -> None:
        """Stop at once (an error or an interrupt in this process): the tasks queued are dropped and the running
        ones' workers are ended, as `multiprocessing.Pool.terminate` did, instead of finishing first. The pool's
        manager thread is joined before the last sweep: it may have been spawning a worker meanwhile."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in self._workers():
            process.terminate()
        self._pool.shutdown(wait=True)  # its workers dead, the manager thread ends (joining any worker it knows)
        self._pool = None
        deadline = time.monotonic() + 10
        for process in self._workers():  # a worker the manager thread reaps meanwhile reads as alive until it has
            process.kill()
            while process.is_alive() and time.monotonic() < deadline:
                process.join(0.05)

    def _workers(self) -> list[multiprocessing.process.BaseProcess]:
        return [process for process in multiprocessing.active_children() if process not in self._others]

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.terminate()
        self.close()

