"""A rank's progress under a torch elastic expiration timer, so that a rank that stops making progress is found
and killed from outside it, at any moment of its life.

A rank frozen by SIGSTOP, or stuck in a collective or a hung device, cannot report itself: detection must
live in another process. torch's elastic agent serves expiration timers over a named pipe
(`torch.distributed.elastic.timer`, `TORCHELASTIC_TIMER_FILE`); our agent (pretrain/launch/agent.py) runs
that server, sets the two limits below, and kills a rank whose timer ran out. Here the rank holds one timer at
every moment, named after what it is doing, so the agent also knows where a rank was when it died:

    start-up          armed by the agent the moment it starts the rank (imports, joining the process group,
                      rank 0 hashing the shards): the rank cannot announce anything before its imports
    <stage>           `stage()`: the resume checks, building a phase's model and engine
    phaseN step S     `begin()`: from the start of one optimizer step to the start of the next (the step, its
                      validation, metrics and checkpoint; at a phase end its export and the wait for it)
    teardown          `teardown()`: from the run's end (the last step, a stop, a failure) to the process's exit,
                      under the smaller of the two limits; never released

Start-up, the stages and the first step after them (compilation, DeepSpeed's first allocations) run under
`run.startup_timeout_minutes` (STARTUP_TIMEOUT_ENV); every later step under `run.hang_timeout_minutes`
(HANG_TIMEOUT_ENV). `startup_limited` is the one rule, read by both sides. A checkpoint save counts as progress:
each file a rank writes starts its clock again (`progress`), so only a save that writes nothing for the whole
limit is a hang. A rank that waits at a collective for a frozen peer runs out too: the agent names the frozen one.

Evidence: before the agent kills a hung rank it sends STACKS_SIGNAL, on which `dump_stacks_on_signal` (installed
first thing by the driver) writes the Python stack of every thread to stderr, the rank's log.

Rehearsal: with HOLD_FILE_ENV naming a file that holds a timer's name ("phase1 step 23"), every rank waits before
that step (or a later one) begins for as long as the file says so, its timer released; a file that says "teardown"
holds every rank on its way out with its timer running (a rehearsed hang at exit). Tests use it to act at a
known step whatever the machine's speed; an operator can use it the same way to rehearse a fault.

The end: `tell_run_ended` writes the rank's last word to its log once its run has ended of itself ("complete", or
the stop it was asked for): whatever ends the process after it (its teardown timer, NCCL's destructors aborting it)
is then no fault for the agent, never a restart, and the job's status is the run's (pretrain/launch/faults.py).

Without the agent (a plain process, a fine-tune's srun tasks, in-process tests) the watch is off and costs nothing.
Standard library only at import (torch's timer client is imported only under the agent).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HANG_TIMEOUT_ENV = "BERT_DS_HANG_TIMEOUT_S"  # set by pretrain/launch/agent.py for its ranks
STARTUP_TIMEOUT_ENV = "BERT_DS_STARTUP_TIMEOUT_S"  # likewise
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"  # torch's: the agent's timer pipe
HOLD_FILE_ENV = "BERT_DS_HOLD_FILE"  # rehearsal: hold before the step this file names (module docstring)
START_UP = "start-up"  # the scope the agent arms for every rank it starts
TEARDOWN = "teardown"  # the scope a rank holds from its last step to its exit (`teardown`)
STACKS_SIGNAL = signal.SIGUSR2  # the agent asks a hung rank for its stacks before killing it
RUN_ENDED_PREFIX = "run ended: "  # a rank's last word in its log under the agent (`tell_run_ended`)
_STEP = re.compile(r"(phase\d+) step (\d+)")


def step_scope(phase: str, step: int) -> str:
    """The timer's name, read back by the agent: 'phase1 step 12'."""
    return f"{phase} step {step}"


def parse_step(scope: str | None) -> tuple[str, int] | None:
    """(phase, step) of a step timer's name; None for start-up and the stages."""
    found = _STEP.fullmatch(scope or "")
    return (found[1], int(found[2])) if found else None


def startup_limited(scope: str, previous: str | None) -> bool:
    """Whether a timer named `scope`, taken after one named `previous`, runs under the start-up limit: start-up,
    the stages, and the first step after them (the agent applies the same rule to name the limit that ran out)."""
    return parse_step(scope) is None or parse_step(previous) is None


def tell_run_ended(outcome: str) -> None:
    """Under the agent (its timer pipe set), say in the rank's log (stderr, which the agent reads on a failure) that
    its run has ended with `outcome`; without it nothing (stderr is the terminal, where `done: ...` said it)."""
    if os.environ.get(TIMER_FILE_ENV):
        print(f"{RUN_ENDED_PREFIX}{outcome}", file=sys.stderr, flush=True)


def dump_stacks_on_signal() -> None:
    """STACKS_SIGNAL writes every thread's Python stack to stderr (the rank's log under the agent), from C: it works
    while the interpreter is stuck in a collective or a device call."""
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


@dataclass
class StepWatch:
    """Times this process's progress (see the module docstring); `client` None: off."""

    client: Any = None
    timeout_s: float = 0.0  # run.hang_timeout_minutes
    startup_s: float = 0.0  # run.startup_timeout_minutes
    scope: str | None = None  # the timer held now
    limit_s: float = 0.0  # its limit
    hold_file: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepWatch:
        env = os.environ if env is None else env
        hold = env.get(HOLD_FILE_ENV) or None
        if not (env.get(TIMER_FILE_ENV) and env.get(HANG_TIMEOUT_ENV) and env.get(STARTUP_TIMEOUT_ENV)):
            return cls(hold_file=hold)
        from torch.distributed.elastic.timer import FileTimerClient  # only under the agent

        startup = float(env[STARTUP_TIMEOUT_ENV])
        # the agent armed START_UP for this process when it started it: that is the timer held now
        return cls(FileTimerClient(env[TIMER_FILE_ENV]), float(env[HANG_TIMEOUT_ENV]), startup, START_UP, startup,
                   hold)

    def stage(self, name: str) -> None:
        """Start-up work other than a step begins (the resume checks, a phase's engine): timed by the start-up limit."""
        self._take(name, self.startup_s)

    def begin(self, phase: str, step: int) -> None:
        """Step `step` (1-based) of `phase` starts: its timer replaces the one held, and runs until the next."""
        scope = step_scope(phase, step)
        self._hold(phase, step)
        self._take(scope, self.startup_s if startup_limited(scope, self.scope) else self.timeout_s)

    def progress(self) -> None:
        """Work that moves on (a checkpoint file written, an export begun): the held timer starts again."""
        if self.client is not None and self.scope is not None:
            self.client.acquire(self.scope, time.time() + self.limit_s)

    def teardown(self) -> None:
        """The run is over (done, stopped, or failed): from here to the process's exit, closing the metrics and
        tearing down the process group, the smaller of the two limits times it (the work of a step's size: the
        hang limit by default; never more than the start-up limit), and the timer is never released (the agent's
        server forgets it once the process is gone). A rank that hangs on its way out (a collective's destructor, a
        file system that does not answer) is named "during teardown" and killed, not left holding the job.
        Rehearsal: a hold file that says TEARDOWN holds the rank here with its timer running, as such a hang would."""
        self._take(TEARDOWN, min(self.timeout_s, self.startup_s))
        while self.hold_file and self._says(TEARDOWN):
            time.sleep(0.1)

    def end(self) -> None:
        """Nothing timed until the next stage or step (the run holds)."""
        if self.client is not None and self.scope is not None:
            self.client.release(self.scope)
        self.scope = None

    def _take(self, scope: str, limit_s: float) -> None:
        if self.client is None:
            self.scope = scope
            return
        self.end()
        self.scope, self.limit_s = scope, limit_s
        self.client.acquire(scope, time.time() + limit_s)

    def _hold(self, phase: str, step: int) -> None:
        """Wait before (phase, step) while the hold file names it or an earlier step (module docstring)."""
        if not (self.hold_file and self._held_at(phase, step)):
            return
        if self.client is not None and self.scope is not None:
            self.client.release(self.scope)  # nothing timed while held; the next step is an ordinary one
        while self._held_at(phase, step):
            time.sleep(0.1)

    def _held_at(self, phase: str, step: int) -> bool:
        target = parse_step(self._hold_text())
        return target is not None and (phase, step) >= target

    def _says(self, scope: str) -> bool:
        return self._hold_text() == scope

    def _hold_text(self) -> str | None:
        try:
            with open(str(self.hold_file), encoding="utf-8") as file:
                return file.read().strip()
        except OSError:
            return None
