"""Time budget per part of the check: each part (the self-test table, one engine's rows, the LAMB rows) gets a
share of the 9.5-minute limit, so that one part that overruns (a compile storm, a slow first kernel, a hung data
worker) is stopped and said in the file while the parts after it still run.

The budgets are estimates for one H100 or H200 (nothing has been measured on one yet; docs/performance.md gives
each part's estimate); together with the start-up they fit gpu_check.sh's limit (`fits_limit`). A part's clock
starts when the part starts; a row that would start with its part's time spent is skipped, a row running when it
runs out is stopped by SIGALRM, which raises `PartOverrun` in the check's main thread. `PartOverrun` is a
BaseException, like KeyboardInterrupt, so that torch's and DeepSpeed's `except Exception` (the compiled layer's
fallback among them) cannot mistake the stop for a failure of their own and go on. A part run in a child process
(the self-tests on CUDA) ends the child before the part's time is up (`child_limit_s`) instead.
"""

from __future__ import annotations

import argparse
import math
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType

# Seconds per part on one H100 / H200 (estimated; docs/performance.md "Time budget"); a part not named here (another
# recipe's phase, e.g. "bert_base:p1") gets OTHER_PART_S (the "*" budget).
DEFAULT_PART_S = {"selftest": 120.0, "p1": 120.0, "p2": 75.0, "lamb": 60.0, "p1-timer-on": 30.0, "p1-big": 35.0,
                  "p2-big": 35.0}
OTHER_PART_S = 30.0
START_UP_S = 50.0  # preflight's imports, the check's imports and its NCCL world of one, before the first part
LIMIT_S = 570.0  # gpu_check.sh's hard limit, start-up included (SIGKILL 20 s later: within 10 minutes)
CHILD_MARGIN_S = 5.0  # a child process is killed this long before its part's time is up (its kill and join)


class PartOverrun(BaseException):
    """Raised by SIGALRM in the check's main thread when the running part's time is up."""


def budget_arg(text: str) -> dict[str, float] | None:
    """PART=SECONDS,... (replacing those parts' budgets; "*": every part not named), or "none" (no part budgets)."""
    if text.lower() == "none":
        return None
    budgets = {}
    for item in (item for item in text.split(",") if item):
        name, _, seconds = item.partition("=")
        try:
            budgets[name] = float(seconds)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected PART=SECONDS (e.g. p1=150), got {item!r}") from err
        if not budgets[name] > 0:
            raise argparse.ArgumentTypeError(f"{item!r}: a budget must be > 0 seconds")
    return budgets


def part_budgets(given: dict[str, float] | None, smoke: bool) -> dict[str, float] | None:
    """The budgets a run uses: the defaults with --part-budget's replacing them; none under --smoke (CPU times are
    not an H100's) unless --part-budget names some, none with --part-budget none."""
    if given is None or (smoke and not given):
        return None
    return {**({} if smoke else {**DEFAULT_PART_S, "*": OTHER_PART_S}), **given}


def fits_limit(parts: list[str], budgets: dict[str, float]) -> float:
    """Seconds the parts and the start-up may take at most; the default plan's stays under LIMIT_S (a test)."""
    return START_UP_S + sum(budget_of(part, budgets) for part in parts)


def budget_of(part: str, budgets: dict[str, float] | None) -> float:
    """The part's seconds: its own budget, else the "*" one (another recipe's phase), else none (inf)."""
    if budgets is None:
        return math.inf
    return budgets.get(part, budgets.get("*", math.inf))


@dataclass
class PartClock:
    """One part's clock: its name, budget (inf: none) and start; whether SIGALRM stopped it."""

    name: str
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    overran: bool = False

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def spent(self) -> float:
        return time.monotonic() - self.started

    def child_limit_s(self, default: float) -> float:
        """The wait for a child process of this part: ends CHILD_MARGIN_S before the part's time is up."""
        return min(default, max(self.left() - CHILD_MARGIN_S, 1.0))

    def record(self) -> dict[str, object]:
        budget = None if math.isinf(self.budget_s) else self.budget_s
        return {"part": self.name, "budget_s": budget, "seconds": self.spent(), "overran": self.overran}


def no_part() -> PartClock:
    """The clock outside any part: no budget."""
    return PartClock("", math.inf)


@contextmanager
def part_clock(name: str, budget_s: float) -> Iterator[PartClock]:
    """The part's clock, with SIGALRM armed at its budget (none for an infinite one); disarmed on leaving."""
    clock = PartClock(name, budget_s)
    if math.isinf(budget_s):
        yield clock
        return

    def on_alarm(_signum: int, _frame: FrameType | None) -> None:
        clock.overran = True
        raise PartOverrun(f"{name}: over its {budget_s:g} s budget")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(budget_s, 1e-3))
    try:
        yield clock
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def alarm_deferred() -> Iterator[None]:
    """SIGALRM held back while the body runs (a row's JSON line being written; a child process, which its own
    limit already bounds and which a stop in the middle of its wait would leave running), delivered after it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
