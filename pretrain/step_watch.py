"""Each optimizer step under a torch elastic expiration timer, so that a rank that stops making progress is
found and killed from outside it.

A rank frozen by SIGSTOP, or stuck in a collective or a hung device, cannot report itself: detection must
live in another process. torch's elastic agent serves expiration timers over a named pipe
(`torch.distributed.elastic.timer`, `TORCHELASTIC_TIMER_FILE`); our agent (pretrain/launch/elastic.py) runs
that server, sets BERT_DS_HANG_TIMEOUT_S, and kills a rank whose timer ran out. Here each step acquires a
timer named after the step ("phase1 step 12") and releases it when the step is done, so the agent also
knows at which step a rank was when it died, whatever killed it.

What is timed: the optimizer steps of a launch after its first. Start-up (imports, rank 0 hashing shards, a
resume's conversion), the first step (compilation, DeepSpeed's first allocations), validation, checkpoint
saves and exports are not: they may take long and are progress. The first step still announces itself,
with a timer that never runs out, so that a crash there is reported with its step.

Without the agent (a plain process, SLURM's srun tasks, in-process tests) the watch is off and costs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

HANG_TIMEOUT_ENV = "BERT_DS_HANG_TIMEOUT_S"  # set by pretrain/launch/elastic.py for its ranks
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"  # torch's: the agent's timer pipe
NEVER_S = 10 * 365 * 24 * 3600.0  # the first step's timer: only names the step


def step_scope(phase: str, step: int) -> str:
    """The timer's name, read back by the agent: 'phase1 step 12'."""
    return f"{phase} step {step}"


@dataclass
class StepWatch:
    """Times each step of this process (see the module docstring); `client` None: off."""

    client: Any = None
    timeout_s: float = 0.0
    timed_steps: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepWatch:
        env = os.environ if env is None else env
        if not (env.get(TIMER_FILE_ENV) and env.get(HANG_TIMEOUT_ENV)):
            return cls()
        from torch.distributed.elastic.timer import FileTimerClient  # only under the agent

        return cls(FileTimerClient(env[TIMER_FILE_ENV]), float(env[HANG_TIMEOUT_ENV]))

    @contextmanager
    def _timed(self, scope: str, after: float) -> Iterator[None]:
        from torch.distributed.elastic.timer import expires

        with expires(after=after, scope=scope, client=self.client):
            yield

    def step(self, phase: str, step: int) -> Any:
        """A context manager around step `step` (1-based) of `phase`: timed unless the watch is off."""
        if self.client is None:
            return nullcontext()
        first = self.timed_steps == 0
        self.timed_steps += 1
        return self._timed(step_scope(phase, step), NEVER_S if first else self.timeout_s)
