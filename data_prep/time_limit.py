"""A per-document time limit in a cleaning worker: the last resort behind the caps that are counted.

The wikitext parser is a C extension and cannot be cancelled from another thread, but it calls back into
Python as it builds its tokens, and `re` checks for signals as it matches, so a SIGALRM handler that raises
interrupts both within milliseconds. The timer is the process's real-time interval timer, so it is only
set from the main thread (a worker's tasks run there, and so does an in-process build); elsewhere no limit
is set, nor while another timer of the process runs (a test runner's, say). The previous handler is put
back afterwards.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TimeLimitExceeded(Exception):
    """The work inside `time_limit` ran out of its seconds."""


def _on_alarm(_signum: int, _frame: object) -> None:
    raise TimeLimitExceeded


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeLimitExceeded inside the block once it has run `seconds` of wall-clock time."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() \
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0:  # someone else's timer is running: leave it be
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
