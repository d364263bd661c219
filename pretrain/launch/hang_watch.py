"""The agent's timer server: torch's FileTimerServer, started once per agent, serving every attempt's ranks.

Each rank holds one of torch's expiration timers at every moment (pretrain/distributed/step_watch.py): START_UP,
armed here the moment the agent starts the rank, then the stages and steps the rank announces over the named pipe.
What this server adds to torch's (the private hooks it relies on are listed in pretrain/launch/agent.py):

- it never kills its own process: torch's server ends the agent after reaping a hung worker; this one kills the
  rank only, and the agent restarts the group;
- evidence first: a hung rank is sent STACKS_SIGNAL (its Python stacks go to its log) and on GPUs a word on NCCL's
  dump pipe (its recent collectives to a file), given a moment to write them, then killed. A rank stopped by a
  signal is named as such and not asked: it could answer only if it were let run again;
- a rank frozen between two timers' ends (its peer, waiting in a collective, runs out first) is found in /proc
  (state T), named, asked for its stacks and killed with it;
- the fault line's words: the timer each rank held last ("phase1 step 12", "start-up") and under which limit it
  ran (step_watch.startup_limited: run.startup_timeout_minutes or run.hang_timeout_minutes).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.timer import FileTimerRequest, FileTimerServer

from pretrain.distributed.step_watch import (
    HANG_TIMEOUT_ENV,
    STACKS_SIGNAL,
    START_UP,
    STARTUP_TIMEOUT_ENV,
    TEARDOWN,
    TIMER_FILE_ENV,
    startup_limited,
)
from pretrain.launch.faults import hang_description
from pretrain.launch.processes import catches, pending, process_start, process_state, running, stderr_size
from pretrain.launch.rank_logs import NCCL_PIPE_ENV, flight_recorder
from pretrain.launch.timer_pipes import make_pipe_path, remove_pipe_folder, remove_stale_timer_pipes

STACKS_WAIT_S = 1.0  # the most a hung rank gets to write its stacks before it is killed
STACKS_QUIET_S = 0.2  # written: the signal taken, its log grown since and then unchanged this long (wait_for_stacks)
NCCL_DUMP_WAIT_S = 3.0  # and its NCCL watchdog to notice the dump request (it looks about once a second) and write


@dataclass(frozen=True)
class Limits:
    """The two limits a rank's timers run under (seconds), as the run config names them."""

    hang_s: float
    startup_s: float

    def of(self, startup: bool) -> tuple[float, str]:
        """(seconds, the run config's key) of the start-up limit or of the hang limit."""
        return (self.startup_s, "run.startup_timeout_minutes") if startup else (self.hang_s, "run.hang_timeout_minutes")


class HangWatch(FileTimerServer):
    """torch's timer server for the ranks of every attempt of one agent (module docstring)."""

    def __init__(self, file_path: str, limits: Limits) -> None:
        super().__init__(file_path, run_id="", max_interval=0.1, daemon=True)
        self.path, self.limits = file_path, limits
        self.last_step: dict[int, str] = {}  # pid -> the timer it took last
        self.startup: dict[int, bool] = {}  # pid -> whether that timer runs under the start-up limit
        self.hung: dict[int, str] = {}  # pid -> "made no progress in ..." for the fault line
        self.ranks: dict[int, int] = {}  # pid -> global rank, for NCCL's dump pipe
        self.stacks: set[int] = set()  # pids asked for their stacks before they were killed
        self.started: dict[int, int | None] = {}  # pid -> its start time (processes.process_start) when armed
        self.tearing_down: set[int] = set()  # pids past their run's end (step_watch.TEARDOWN)
        self.killed: dict[int, int | None] = {}  # pid -> its start time, once killed here

    def arm(self, pid: int, rank: int) -> None:
        """Time rank `pid`'s start-up from now: it cannot announce itself before its imports are done. Sent through
        the pipe as a rank's own request would be (the server reads nothing until someone writes to it)."""
        self.ranks[pid] = rank
        self.started[pid] = process_start(pid)
        request = FileTimerRequest(pid, START_UP, time.time() + self.limits.startup_s, signal.SIGKILL)
        for _ in range(50):  # the server's thread opens its end as it starts: wait for it, briefly
            try:
                pipe = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as err:
                if err.errno != errno.ENXIO:
                    raise
                time.sleep(0.02)
        else:
            raise RuntimeError(f"the timer server does not read {self.path}")
        try:
            os.write(pipe, (request.to_json() + "\n").encode())
        finally:
            os.close(pipe)

    def register_timers(self, timer_requests: list[Any]) -> None:
        # the agent's START_UP for a rank that already took a timer of its own (it cannot happen: imports take
        # seconds) would outlive that rank's start-up: dropped
        requests = [r for r in timer_requests if not (r.scope_id == START_UP and r.worker_pid in self.last_step)]
        for request in requests:
            previous = self.last_step.get(request.worker_pid)
            if request.expiration_time >= 0 and request.scope_id == TEARDOWN:
                # on its way out, under the smaller limit (step_watch.teardown); where it was (the step a failure
                # names) stays what it did last
                self.startup[request.worker_pid] = self.limits.startup_s < self.limits.hang_s
                self.tearing_down.add(request.worker_pid)
            elif request.expiration_time >= 0 and request.scope_id != previous:
                self.startup[request.worker_pid] = startup_limited(request.scope_id, previous)
                self.last_step[request.worker_pid] = request.scope_id
        super().register_timers(requests)

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():  # torch ends the agent too; we restart instead
            return True
        if worker_pid in self.started and process_start(worker_pid) != self.started[worker_pid]:
            return True  # it has exited holding its timer (a rank keeps its teardown timer to its end): nothing to reap
        if worker_pid in self.killed and self.killed[worker_pid] == self.started.get(worker_pid):
            return True  # killed here with the peer that timed out first, and still dying: not asked for stacks again
        # A rank frozen between two timers holds none that runs out; the peer waiting for it in a collective times
        # out instead. Name the frozen one too (primary_failure puts a stopped rank first), and end it with its peer.
        frozen = [pid for pid in self.last_step if pid != worker_pid and process_state(pid) in ("T", "t")]
        for pid in [worker_pid, *frozen]:
            self.hung.setdefault(pid, self.no_progress(pid))  # its state before it is continued for its stacks
        self.stacks |= ask_for_stacks([worker_pid, *frozen], self.ranks)
        for pid in [*frozen, worker_pid]:
            self.killed[pid] = self.started.get(pid)
        for pid in frozen:
            super()._reap_worker(pid, signal)
        return super()._reap_worker(worker_pid, signal)

    def stop(self) -> None:
        super().stop()  # torch removes the pipe
        remove_pipe_folder(self.path)

    def step_of(self, pid: int) -> str | None:
        """Where a rank was, for its fault line: the timer it took last, or TEARDOWN when that timer killed it on its
        way out (a rank that failed and then left names the step it failed at)."""
        return TEARDOWN if pid in self.tearing_down and pid in self.hung else self.last_step.get(pid)

    def no_progress(self, pid: int) -> str:
        seconds, key = self.limits.of(self.startup.get(pid, True))
        return f"made no progress in {seconds / 60:g} min ({hang_description(process_state(pid))}; {key})"


def ask_for_stacks(pids: list[int], ranks: dict[int, int]) -> set[int]:
    """STACKS_SIGNAL to each that can answer and, on GPUs, a word on NCCL's dump pipe (its flight recorder's
    collectives to a file); then the time to write them. Returns the pids asked. Not asked: a rank that has no handler
    yet (the signal's default action would end it), and a stopped one (state T: it could write its stacks only if it
    were let run again, and then it would go on training while its peers are being killed; "stopped by SIGSTOP" is
    its evidence)."""
    asked: dict[int, int | None] = {}  # pid -> the size of its log before it was asked
    traced = False
    for pid in pids:
        if process_state(pid) in ("T", "t") or not catches(pid, STACKS_SIGNAL):
            continue
        before = stderr_size(pid)
        try:
            os.kill(pid, STACKS_SIGNAL)
        except ProcessLookupError:
            continue
        asked[pid] = before
        traced = ask_nccl_for_trace(ranks.get(pid)) or traced
    if traced:  # NCCL's watchdog writes its trace to a file of its own, about once a second
        time.sleep(STACKS_WAIT_S + NCCL_DUMP_WAIT_S)
    elif asked:
        wait_for_stacks(asked)
    return set(asked)


def wait_for_stacks(asked: dict[int, int | None], limit_s: float = STACKS_WAIT_S) -> set[int]:
    """Until each rank of `asked` (pid -> its log's size before it was asked) has written its stacks or is gone, at
    most `limit_s`. The stacks are written by the signal's C handler (faulthandler) the moment a thread takes the
    signal: they are there once it is no longer pending and the log, grown since, has not changed for STACKS_QUIET_S.
    A fault's restart waits for that, a fraction of a second, not for the whole limit. A rank whose stderr is no file
    (a terminal) gets the whole limit. Returns the pids not seen writing them (still running)."""
    deadline = time.monotonic() + limit_s
    seen: dict[int, tuple[int, float]] = {}  # pid -> (its log's size, when first seen at that size)
    left = dict(asked)
    while left and time.monotonic() < deadline:
        now = time.monotonic()
        for pid, before in list(left.items()):
            size = stderr_size(pid)
            if not running(pid):
                del left[pid]
            elif before is None or size is None or size <= before or pending(pid, STACKS_SIGNAL):
                continue  # not taken yet, or nothing written yet
            elif pid not in seen or seen[pid][0] != size:
                seen[pid] = (size, now)
            elif now - seen[pid][1] >= STACKS_QUIET_S:
                del left[pid]
        if left:
            time.sleep(0.02)
    return set(left)


def ask_nccl_for_trace(rank: int | None) -> bool:
    """Write to NCCL's dump pipe of `rank` (TORCH_NCCL_DEBUG_INFO_PIPE_FILE + rank + ".pipe", created by its process
    group when the flight recorder is on): its watchdog thread then dumps the trace, whatever the main thread does."""
    prefix = os.environ.get(NCCL_PIPE_ENV)
    if not prefix or rank is None:
        return False
    try:
        pipe = os.open(f"{prefix}{rank}.pipe", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no pipe: not an NCCL rank, or not that far yet
        return False
    try:
        os.write(pipe, b"1")
    except OSError:
        return False
    finally:
        os.close(pipe)
    return True


def watch_ranks(limits: Limits, launch_dir: Path) -> HangWatch:
    """Start our timer server once for every attempt, and set what the ranks inherit: its pipe and limits (torch then
    starts no server of its own: TORCHELASTIC_ENABLE_FILE_TIMER unset), and on GPUs NCCL's flight recorder."""
    folder = os.environ.get("TMPDIR", "/tmp")
    remove_stale_timer_pipes(folder)
    watch = HangWatch(make_pipe_path(folder), limits)  # in a 0700 folder of its own (pretrain/launch/timer_pipes.py)
    watch.start()
    os.environ.pop("TORCHELASTIC_ENABLE_FILE_TIMER", None)
    os.environ.update({TIMER_FILE_ENV: watch.path, HANG_TIMEOUT_ENV: str(limits.hang_s),
                       STARTUP_TIMEOUT_ENV: str(limits.startup_s)})
    if os.environ.get("DS_ACCELERATOR") != "cpu":  # gloo has no flight recorder
        for name, value in flight_recorder(launch_dir).items():
            os.environ.setdefault(name, value)
    return watch
