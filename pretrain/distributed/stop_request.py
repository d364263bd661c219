"""How a running job is asked to stop: signals become a request the training loop acts on at a step boundary.

The handler only records the signal (a flag read between steps), so the loop always stops where a
checkpoint is consistent; the ranks then agree on the stop through the step's statistics all-reduce
(pretrain/trainer.py), so one rank's signal stops every rank at the same step.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StopRequest:
    """Set by SIGTERM/SIGUSR1 (SLURM preemption), SIGHUP (a closed terminal) or a first SIGINT (Ctrl-C): the loop
    checkpoints and returns at the next step boundary. A second SIGINT ends the process at once, exit 130,
    without a checkpoint or a traceback (launch.sh passes each Ctrl-C to every rank). Rank 0 says each in one line.
    """

    signal_name: str | None = None
    interrupts: int = 0
    installed: list[tuple[int, Any]] = field(default_factory=list)

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

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):
            self.installed.append((signum, signal.signal(signum, self._handle)))

    def uninstall(self) -> None:
        for signum, previous in self.installed:
            signal.signal(signum, previous)
        self.installed.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self._say("second SIGINT: aborting now, without a checkpoint")
                os._exit(130)
            self._say("SIGINT: stopping with a checkpoint at the end of this step (Ctrl-C again aborts without one)")
        self.signal_name = self.signal_name or signal.Signals(signum).name

    @staticmethod
    def _say(message: str) -> None:
        # os.write, not print: a handler that interrupts a print to the same stream would raise "reentrant call".
        # stdout: under the elastic agent a rank's stderr goes to its log file (pretrain/launch/agent.py).
        if os.environ.get("RANK", "0") == "0":
            os.write(1, f"{message}\n".encode())
