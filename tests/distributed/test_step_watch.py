"""pretrain/distributed/step_watch.py against torch's own timer server: what a rank holds from one step to the next, what
counts as progress (each checkpoint file written), and that a rank which stops making progress is found by the
server while one that writes is not. The end-to-end hang (a rank frozen by SIGSTOP under the agent) is
tests/launch/test_faults.py."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.timer import FileTimerClient, FileTimerServer

from pretrain.checkpointing.commit import SaveAttempt
from pretrain.distributed.step_watch import NEVER_S, StepWatch


class Recording(FileTimerServer):
    """torch's timer server on a fresh pipe, keeping what it was told (scope -> expiration) and which
    workers it would have killed (it kills nobody: the worker is this test)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "test", max_interval=0.05, daemon=True)
        self.timers: dict[str, float] = {}
        self.reaped: list[str] = []

    def register_timers(self, timer_requests: list) -> None:
        for request in timer_requests:
            if request.expiration_time < 0:
                self.timers.pop(request.scope_id, None)
            else:
                self.timers[request.scope_id] = request.expiration_time
        super().register_timers(timer_requests)

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        self.reaped += [scope for scope, expiry in self.timers.items() if expiry <= time.time()]
        return True


class Served:
    def __init__(self, folder: Path) -> None:
        path = str(folder / f"timers-{uuid.uuid4().hex}")
        self.server = Recording(path)
        self.server.start()
        self.client = FileTimerClient(path)

    def held(self) -> dict[str, float]:
        """scope -> expiration of this process's timers, once the server has read the pipe."""
        time.sleep(0.3)  # the server reads its pipe every 0.05 s
        return dict(self.server.timers)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def served(tmp_path: Path):
    served = Served(tmp_path)
    yield served
    served.stop()


def test_a_rank_holds_one_timer_from_a_step_to_the_next(served: Served) -> None:
    watch = StepWatch(served.client, timeout_s=60.0)
    watch.begin("phase1", 5)  # the first step of a launch: named, never runs out
    assert served.held().keys() == {"phase1 step 5"}
    assert served.held()["phase1 step 5"] > time.time() + NEVER_S / 2
    watch.begin("phase1", 6)  # replaces it: the step, its validation, metrics and checkpoint, until step 7
    held = served.held()
    assert held.keys() == {"phase1 step 6"} and held["phase1 step 6"] < time.time() + 61
    first = held["phase1 step 6"]
    time.sleep(0.5)
    watch.progress()  # a checkpoint file written: the clock starts again
    assert served.held()["phase1 step 6"] >= first + 0.5
    watch.end()  # the phase's export is done: nothing timed while the next engine is built
    assert served.held() == {} and watch.scope is None
    watch.progress()  # nothing held: nothing to renew
    assert served.held() == {}


def test_a_rank_that_stops_writing_during_a_save_runs_out_and_one_that_writes_does_not(served: Served) -> None:
    watch = StepWatch(served.client, timeout_s=0.6, timed_steps=1)
    watch.begin("phase1", 9)
    attempt = SaveAttempt(0, watch.progress)
    for _ in range(5):  # a save whose files keep coming, 0.25 s apart, for twice the limit
        time.sleep(0.25)
        attempt.write("mp_rank_00_model_states.pt", lambda: None)
    assert served.server.reaped == []
    attempt.write("zero_pp_rank_0_optim_states.pt", lambda: (_ for _ in ()).throw(OSError(28, "No space left")))
    time.sleep(1.0)  # a failed write is no progress, and nothing written since: the limit passes
    assert served.server.reaped[:1] == ["phase1 step 9"]
    assert attempt.failure and "No space left" in attempt.failure


def test_without_the_agent_the_watch_is_off() -> None:
    watch = StepWatch.from_env({})
    watch.begin("phase1", 1)
    watch.progress()
    watch.end()
    assert watch.client is None and watch.scope is None
