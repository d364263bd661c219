"""Faults as a cluster writes them: each text of tests/launch/fixtures/fault_texts/ (captured from real gloo ranks
whose peer was SIGKILLed, or built from torch's NCCL format strings, multi-line as torch raises them) read by the
launcher (pretrain/launch/fault_texts.py, faults.failure_order), and the verdicts of two nodes replayed with them
through the real judge, record writer (FaultHistory, the agent's JSON line) and the launcher's FaultLines: a victim
node never ends the job and never names its own rank; "the same failure again" is the culprit's own repeated cause
only."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest

from pretrain.launch.fault_records import VICTIM_ORDER, FaultLines
from pretrain.launch.fault_texts import exception_line
from pretrain.launch.faults import (
    RECORD_PREFIX,
    FaultContext,
    FaultHistory,
    RankFailure,
    failure_order,
    judge,
)
from tests.support.fault_texts import FAULT_TEXTS, fault_text, write_rank_log

ABRT = -signal.SIGABRT
# fixture: (the status the rank ended with, victim?, how its exception line starts)
READINGS = {
    "gloo_allreduce_peer_killed": (1, True, "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"),
    "culprit_index_error_peer": (1, True, "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"),
    "store_server_killed": (1, True, "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes."),
    "store_waiting_for_clients": (1, True, "torch.distributed.DistStoreError: Timed out after 6 seconds waiting"),
    "culprit_index_error": (1, False, "IndexError: index out of range in self"),
    "culprit_port_taken": (1, False, "torch.distributed.DistNetworkError: The server socket has failed to listen"),
    "nccl_remote_error": (1, True, "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/"),
    "nccl_async_remote_error": (1, True, "torch.distributed.DistBackendError: NCCL error: remote process exited"),
    "nccl_system_error_peer_closed": (1, True, "torch.distributed.DistBackendError: NCCL error in: /pytorch/"),
    "nccl_system_error_own": (1, False, "torch.distributed.DistBackendError: NCCL error in: /pytorch/"),
    "nccl_unhandled_cuda_error": (1, False, "torch.distributed.DistBackendError: NCCL error in: /pytorch/"),
    "nccl_watchdog_timeout_sigabrt": (ABRT, True, "what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group"),
    "nccl_watchdog_cuda_error_sigabrt": (ABRT, False, "what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Process"),
}


def test_every_fixture_is_read() -> None:
    assert sorted(path.stem for path in FAULT_TEXTS.glob("*.txt")) == sorted(READINGS)


@pytest.mark.parametrize("name", sorted(READINGS))
def test_a_victim_is_told_from_its_whole_last_traceback(tmp_path: Path, name: str) -> None:
    """Victim or culprit, from every line of the rank's last report (the NCCL texts say "a peer is gone" on their
    second or fourth line); the exception that keys "the same failure" is the one Python raised, its first line."""
    status, victim, exception = READINGS[name]
    failure = RankFailure(0, "n0", status, "phase1 step 12", write_rank_log(tmp_path / "rank-0.log", name))
    assert (failure_order(failure) >= VICTIM_ORDER) == victim, (name, failure_order(failure))
    found = exception_line(failure.log)
    assert found is not None and found.startswith(exception), found


def context(run: Path) -> FaultContext:
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    return FaultContext("job-1", 3, run, run / "checkpoints", "./launch.sh pretrain --config run.json")


def replay(run: Path, attempts: list[tuple[tuple[int, str], tuple[int, str]]]) -> list[str]:
    """Two nodes, each attempt judged on both as their agents do (node B, whose rank only lost its peer, first):
    judge() writes each record into the shared history, the agent's JSON line goes to the launcher's FaultLines,
    which shows one line per attempt. Each attempt: ((culprit's status, its text), (B's status, B's text)); the
    culprit's log is written a second before B's (it failed first). Returns the lines shown."""
    history, out = FaultHistory(run / "logs" / "faults"), io.StringIO()
    lines = FaultLines(out, nodes_running=lambda: 2, settle_s=60)
    for restart, ((a_status, a_text), (b_status, b_text)) in enumerate(attempts):
        a_log = write_rank_log(run / f"a/attempt-{restart}/rank-0.log", a_text, 1000.0 + restart * 100)
        b_log = write_rank_log(run / f"b/attempt-{restart}/rank-2.log", b_text, 1001.0 + restart * 100)
        for host, failure in (("nodeB", RankFailure(2, "nodeB", b_status, "phase1 set-up", b_log)),
                              ("nodeA", RankFailure(0, "nodeA", a_status, "phase1 set-up", a_log))):
            record = judge(failure, restart, context(run), history)
            lines.offer(f"{host}: {RECORD_PREFIX}{record.to_json()}\n")
    lines.show_all()
    return out.getvalue().splitlines()


KILLED = (-signal.SIGKILL, "culprit_index_error")  # the culprit's first end: SIGKILL (its log has no say)
OWN_ERROR = (1, "culprit_index_error")
VICTIMS = [name for name, (status, victim, _) in READINGS.items() if victim and status == 1]


@pytest.mark.parametrize("victim", VICTIMS)
def test_a_victim_node_never_ends_the_job_nor_names_its_own_rank(tmp_path: Path, victim: str) -> None:
    """The review's case with every victim text torch writes: node A fails twice during phase1 set-up for two
    causes (SIGKILL, then its own error); node B's rank loses its peer both times with the same multi-line text.
    Before, B read the NCCL and store texts as a culprit's, judged its own record "the same failure as the last
    one ... a bug" and ended the job naming its own healthy rank 2."""
    shown = replay(tmp_path, [(KILLED, (1, victim)), (OWN_ERROR, (1, victim))])
    assert [line.split(";")[0] for line in shown] == [
        "nodeA: launch.sh: fault: rank 0 (host nodeA) died of SIGKILL during phase1 set-up",
        "nodeA: launch.sh: fault: rank 0 (host nodeA) exited with status 1 during phase1 set-up"], shown
    assert "(restart 2 of 3)" in shown[1]


def test_the_same_failure_again_is_the_culprits_own_never_a_nodes_own_record(tmp_path: Path) -> None:
    """Node B's rank ends with a text no list knows as a victim's (its ncclSystemError names its own device), the
    same at both attempts; node A's rank fails first each time, for two causes. B's repeated line is compared with
    the attempt before's culprit (A's, the most telling of every node's records), never with B's own record: no
    "a bug", and the line names A's rank. Before, B's own record matched and B ended the job."""
    unknown = (1, "nccl_system_error_own")
    shown = replay(tmp_path, [((-signal.SIGKILL, "culprit_index_error"), unknown), (OWN_ERROR, unknown)])
    assert all(" fault: rank 0 (host nodeA) " in line and "a bug" not in line for line in shown), shown


def test_the_culprits_own_repeated_cause_still_ends_the_job_naming_the_culprit(tmp_path: Path) -> None:
    """The same own error at the same step twice with no newer checkpoint is a bug: the job ends, and the one line
    names the culprit's rank, however many victims' records came with it."""
    shown = replay(tmp_path, [(OWN_ERROR, (1, "nccl_remote_error")), (OWN_ERROR, (1, "nccl_remote_error"))])
    assert shown[1].startswith("nodeA: launch.sh: error: rank 0 (host nodeA) exited with status 1 during phase1 "
                               "set-up; the same failure as the last one"), shown


def test_a_culprit_that_nccls_watchdog_aborted_for_its_own_gpu_is_named_and_can_repeat(tmp_path: Path) -> None:
    """SIGABRT is a victim's signal, unless the rank's last words are its own CUDA error: then it is the culprit,
    named before an exit-1 victim that failed earlier, and its repeat at the same step is "the same failure"."""
    own_gpu = (ABRT, "nccl_watchdog_cuda_error_sigabrt")
    shown = replay(tmp_path, [(own_gpu, (1, "nccl_async_remote_error")), (own_gpu, (1, "nccl_async_remote_error"))])
    assert shown[0].startswith("nodeA: launch.sh: fault: rank 0 (host nodeA) died of SIGABRT during phase1 set-up;")
    assert shown[1].startswith("nodeA: launch.sh: error: rank 0 (host nodeA) died of SIGABRT during phase1 set-up; "
                               "the same failure as the last one"), shown


def test_a_long_log_is_read_from_its_end(tmp_path: Path) -> None:
    """A rank that logged much before it failed (warnings, its stacks): its last report is still read whole, from
    the end of its log only."""
    log = tmp_path / "rank-0.log"
    noise = "[rank0]: UserWarning: a warning a rank may print at every step\n" * 40_000  # about 2.6 MB
    log.write_text(noise + fault_text("nccl_remote_error"))
    failure = RankFailure(0, "n0", 1, "phase1 step 12", log)
    assert failure_order(failure) >= VICTIM_ORDER
    assert (exception_line(log) or "").startswith("torch.distributed.DistBackendError: NCCL error in:")
