"""Ordered, bounded parallel map: results come back in input order whatever the worker count.

Determinism does not rest on this order (every task is a pure function of its inputs and
writes its own file), but the order keeps progress and statistics reproducible, and the bound
keeps memory flat while a 20 GB dump is streamed into the workers (Pool.imap would read the
whole input ahead).
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _init_worker() -> None:
    # Each worker is one core: keep the tokenizers' Rust thread pool from oversubscribing it.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


class Workers:
    """A process pool (spawned, so no forked Rust/thread state) or, for one worker, in-process."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool = None
        if count > 1:
            self._pool = multiprocessing.get_context("spawn").Pool(count, initializer=_init_worker)

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
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None and exc[0] is not None:
            self._pool.terminate()
            self._pool = None
        self.close()
