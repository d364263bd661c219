"""How a running job is asked to stop: signals become a request the training loop acts on at a step boundary.

The handler only records the signal (a flag read between steps), so the loop always stops where a
checkpoint is consistent; the ranks then agree on the stop through the step's statistics all-reduce
(pretrain/trainer.py), so one rank's signal stops every rank at the same step.

A rank's process holds its handlers from its first lines to its end (for_process): a stop signal that came before
them would end it by the signal's default action (status 143/138, even after its run ended: SLURM's `scancel
--signal` reaches the ranks themselves), so the SLURM entrypoint (pretrain/launch/pin.py) starts the rank with them
ignored (IGNORED), and the request installed first thing is never uninstalled; the process's os._exit ends it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)

@dataclass
class StopRequest:
    """Set by SIGTERM/SIGUSR1 (SLURM preemption), SIGHUP (a closed terminal) or a first SIGINT (Ctrl-C): the loop
    checkpoints and returns at the next step boundary. A second SIGINT ends the process at once, exit 130,
    without a checkpoint or a traceback (launch.sh passes each Ctrl-C to every rank). Rank 0 says each in one line.
    """

    signal_name: str | None = None
    interrupts: int = 0
    installed: list[tuple[int, Any]] = field(default_factory=list)
    lasts: bool = False  # the process's own request (for_process): uninstall() leaves it in place
    exit_status: int = 0  # what the driver exits with after the stop's checkpoint (`leave`; 0: a stop to resume)

    @classmethod
    def current(cls) -> StopRequest:
        """The request this process installed (the driver installs one first thing, before its imports: a signal that
        comes while torch loads is a stop too, acted on at the first step), else a new one, installed."""
        handler = signal.getsignal(signal.SIGTERM)
        found = getattr(handler, "__self__", None)
        if isinstance(found, cls):
            return found
        request = cls()
        request.install()
        return request

    @classmethod
    def for_process(cls) -> StopRequest:
        """The request a rank's process installs first thing and keeps until it exits (module docstring): the driver's
        own uninstall() after its run leaves it, so a stop during the process's teardown is noted, not its end."""
        request = cls.current()
        request.lasts = True
        return request

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            self.installed.append((signum, signal.signal(signum, self._handle)))

    def uninstall(self) -> None:
        if self.lasts:
            return
        for signum, previous in self.installed:
            signal.signal(signum, previous)
        self.installed.clear()

    def leave(self, reason: str, exit_status: int) -> None:
        """A stop the job asks of itself (a slow rank leaving, pretrain/metrics/slow_ranks.py): checkpointed at the
        next step boundary and agreed through the step's all-reduce like a signal's, then the driver exits
        `exit_status` instead of 0. A signal that came first keeps its stop (and its exit 0: a requeue)."""
        if self.signal_name is None:
            self.signal_name, self.exit_status = reason, exit_status

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self._say("second SIGINT: aborting now, without a checkpoint")
                os._exit(130)
            self._say("SIGINT: stopping with a checkpoint at the end of this step (Ctrl-C again aborts without one)")
        self.signal_name = self.signal_name or signal.Signals(signum).name

    @staticmethod
    def ignore_until_installed() -> None:
        """The stop signals ignored (kept so across exec) until a StopRequest is installed: for a process that execs
        the rank (pretrain/launch/pin.py). A stop sent meanwhile is not lost under the agent: it passes a stop on only
        once the rank's handler is there (send_when_caught in pretrain/launch/processes.py)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

    @staticmethod
    def _say(message: str) -> None:
        # os.write, not print: a handler that interrupts a print to the same stream would raise "reentrant call".
        # stdout: under the elastic agent a rank's stderr goes to its log file (pretrain/launch/agent.py).
        if os.environ.get("RANK", "0") == "0":
            os.write(1, f"{message}\n".encode())
