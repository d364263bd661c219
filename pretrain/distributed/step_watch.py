"""A rank's progress under a torch elastic expiration timer, so that a rank that stops making progress is found
and killed from outside it.

A rank frozen by SIGSTOP, or stuck in a collective or a hung device, cannot report itself: detection must
live in another process. torch's elastic agent serves expiration timers over a named pipe
(`torch.distributed.elastic.timer`, `TORCHELASTIC_TIMER_FILE`); our agent (pretrain/launch/agent.py) runs
that server, sets BERT_DS_HANG_TIMEOUT_S, and kills a rank whose timer ran out. Here each step acquires a
timer named after the step ("phase1 step 12"), so the agent also knows at which step a rank was when it died,
whatever killed it.

What is timed, after a launch's first step: everything from the start of one step to the start of the next
(the step, then its validation, metrics and checkpoint), and a phase's export with the wait for it. A
checkpoint save counts as progress: each file a rank writes starts its clock again (`progress`, called by the
checkpoint writer), so only a save that writes nothing for the whole limit is a hang. A rank that finished its
part and waits at a collective for the others holds the same timer: a frozen peer is found there too, by the
waiting ranks' timers running out (the agent then names the frozen one). Not timed: start-up (imports, rank 0
hashing shards, a resume's conversion), building a phase's engine, and the first step of a launch
(compilation, DeepSpeed's first allocations); the first step still announces itself, with a timer that never
runs out, so that a crash there is reported with its step.

Without the agent (a plain process, a fine-tune's srun tasks, in-process tests) the watch is off and costs nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HANG_TIMEOUT_ENV = "BERT_DS_HANG_TIMEOUT_S"  # set by pretrain/launch/agent.py for its ranks
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"  # torch's: the agent's timer pipe
NEVER_S = 10 * 365 * 24 * 3600.0  # the first step's timer: only names the step


def step_scope(phase: str, step: int) -> str:
    """The timer's name, read back by the agent: 'phase1 step 12'."""
    return f"{phase} step {step}"


@dataclass
class StepWatch:
    """Times this process's progress (see the module docstring); `client` None: off."""

    client: Any = None
    timeout_s: float = 0.0
    timed_steps: int = 0
    scope: str | None = None  # the timer held now
    limit_s: float = 0.0  # its limit

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepWatch:
        env = os.environ if env is None else env
        if not (env.get(TIMER_FILE_ENV) and env.get(HANG_TIMEOUT_ENV)):
            return cls()
        from torch.distributed.elastic.timer import FileTimerClient  # only under the agent

        return cls(FileTimerClient(env[TIMER_FILE_ENV]), float(env[HANG_TIMEOUT_ENV]))

    def begin(self, phase: str, step: int) -> None:
        """Step `step` (1-based) of `phase` starts: its timer replaces the one held, and runs until the next."""
        if self.client is None:
            return
        self.end()
        self.scope = step_scope(phase, step)
        self.limit_s = NEVER_S if self.timed_steps == 0 else self.timeout_s
        self.timed_steps += 1
        self.client.acquire(self.scope, time.time() + self.limit_s)

    def progress(self) -> None:
        """Work that moves on (a checkpoint file written, an export begun): the held timer starts again."""
        if self.client is not None and self.scope is not None:
            self.client.acquire(self.scope, time.time() + self.limit_s)

    def end(self) -> None:
        """Nothing timed until the next step (a phase ended: its export is done, the next engine gets built)."""
        if self.client is not None and self.scope is not None:
            self.client.release(self.scope)
        self.scope = None
