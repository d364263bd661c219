"""pretrain/distributed/step_watch.py against torch's own timer server: what a rank holds from start-up to its last
step and under which limit, what counts as progress (each checkpoint file written), that a rank which stops making
progress is found by the server while one that writes is not, the hold file of rehearsals, and the stacks a rank
writes on the agent's signal. The end-to-end hangs (ranks frozen by SIGSTOP under the agent) are
tests/launch/test_faults.py."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.timer import FileTimerClient, FileTimerServer

from pretrain.checkpointing.commit import SaveAttempt
from pretrain.distributed.step_watch import STACKS_SIGNAL, START_UP, StepWatch, parse_step, startup_limited
from pretrain.launch.processes import process_state
from tests.support.paths import REPO_ROOT


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


def wait_until_read(path: str) -> None:
    """Until the server's thread has opened its end of the pipe: a request written before that waits in torch's
    client's retry, and a timer of 0.6 s is then already spent when the server reads it."""
    deadline = time.monotonic() + 10
    while True:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as err:
            if err.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class Served:
    def __init__(self, folder: Path) -> None:
        path = str(folder / f"timers-{uuid.uuid4().hex}")
        self.server = Recording(path)
        self.server.start()
        wait_until_read(path)
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


def test_a_rank_holds_one_timer_from_start_up_to_its_last_step(served: Served) -> None:
    watch = StepWatch(served.client, timeout_s=60.0, startup_s=600.0)
    watch.stage("the resume checks")  # start-up work: the start-up limit
    held = served.held()
    assert held.keys() == {"the resume checks"} and time.time() + 590 < held["the resume checks"] < time.time() + 601
    watch.begin("phase1", 5)  # the first step after it (compilation, first allocations): the start-up limit too
    held = served.held()
    assert held.keys() == {"phase1 step 5"} and held["phase1 step 5"] > time.time() + 590
    watch.begin("phase1", 6)  # replaces it: the step, its validation, metrics and checkpoint, until step 7
    held = served.held()
    assert held.keys() == {"phase1 step 6"} and held["phase1 step 6"] < time.time() + 61
    first = held["phase1 step 6"]
    time.sleep(0.5)
    watch.progress()  # a checkpoint file written: the clock starts again
    assert served.held()["phase1 step 6"] >= first + 0.5
    watch.stage("phase1 teardown")  # between phases: start-up work again, and so is the next first step
    watch.begin("phase2", 1)
    assert served.held()["phase2 step 1"] > time.time() + 590
    watch.end()  # the run is done
    assert served.held() == {} and watch.scope is None
    watch.progress()  # nothing held: nothing to renew
    assert served.held() == {}


def test_the_start_up_limit_covers_start_up_the_stages_and_the_first_step_after_them() -> None:
    assert startup_limited(START_UP, None) and startup_limited("phase1 set-up", START_UP)
    assert startup_limited("phase1 step 1", "phase1 set-up") and startup_limited("phase1 step 7", None)
    assert not startup_limited("phase1 step 8", "phase1 step 7")
    assert parse_step("phase2 step 12") == ("phase2", 12) and parse_step(START_UP) is None


def test_a_rank_that_stops_writing_during_a_save_runs_out_and_one_that_writes_does_not(served: Served) -> None:
    watch = StepWatch(served.client, timeout_s=0.6, startup_s=0.6)
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


def test_a_hold_file_holds_the_rank_before_the_step_it_names_while_it_is_there(served: Served, tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.write_text("phase1 step 3\n")
    watch = StepWatch(served.client, timeout_s=60.0, startup_s=60.0, hold_file=str(hold))
    watch.begin("phase1", 2)  # before the step named: no hold
    threading.Timer(0.5, hold.unlink).start()
    began = time.monotonic()
    watch.begin("phase1", 3)  # held until the file goes, its timer released meanwhile
    assert time.monotonic() - began >= 0.4 and served.held().keys() == {"phase1 step 3"}
    hold.write_text("phase1 step 9")  # a later step: no hold now
    watch.begin("phase1", 4)
    assert served.held().keys() == {"phase1 step 4"}


def test_without_the_agent_the_watch_is_off() -> None:
    watch = StepWatch.from_env({})
    watch.stage("the resume checks")
    watch.begin("phase1", 1)
    watch.progress()
    watch.end()
    assert watch.client is None and watch.scope is None


def test_a_rank_writes_its_stacks_to_stderr_on_the_agents_signal() -> None:
    """faulthandler from C: the stacks come out while the main thread is blocked (here: in a sleep).

    The signal goes only once the child sleeps, so the stack names the sleeping line on any machine.
    """
    code = ("import time\nfrom pretrain.distributed.step_watch import dump_stacks_on_signal\n"
            "dump_stacks_on_signal()\nprint('ready', flush=True); time.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 30
        while process_state(child.pid) != "S" and time.monotonic() < deadline:
            time.sleep(0.01)
        child.send_signal(STACKS_SIGNAL)
        time.sleep(0.5)
    finally:
        child.kill()
        _, stderr = child.communicate()
    assert "most recent call first" in stderr and 'File "<string>", line 4' in stderr, stderr
