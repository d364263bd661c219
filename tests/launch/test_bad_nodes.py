"""A bad or slow host leaves the job under --nodes MIN:MAX (pretrain/launch/bad_nodes.py), decided by the real judge
(pretrain/launch/faults.py) on real rank logs (torch's own texts, tests/launch/fixtures/fault_texts/) and the real
shared fault history; then told by the real NodeJob (pretrain/launch/nodes.py), and kept out of a SLURM requeue. No
launch here: tests/launch/test_hostfile.py and test_slurm_faults.py drop a node of a running job."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from pretrain.errors import EVICT_PREFIX, NODES_SPARE_ENV, SLOW_EVICT_EXIT
from pretrain.launch.agent import telling_rounds
from pretrain.launch.agent_end import leave
from pretrain.launch.bad_nodes import HostFaults, Room, at_start
from pretrain.launch.excluded_hosts import excluded, run_dir_of, slurm_hosts
from pretrain.launch.fault_records import FaultLines
from pretrain.launch.faults import FaultContext, FaultHistory, FaultRecord, RankFailure, judge
from pretrain.launch.nodes import NODE_LOST_SIGNAL, NodeJob
from pretrain.launch.transports import Pdsh, SessionEnd, Srun
from tests.support.cluster.processes import free_port
from tests.support.fault_texts import write_rank_log

ROOM = Room(nodes=3, low=2, high=3)  # a world of 3 nodes under --nodes 2:3: one may leave
NO_RATE = HostFaults(limit=0)


def failure(log: Path, host: str = "n2", exitcode: int = 1, step: str | None = "phase1 set-up",
            rank: int = 1) -> RankFailure:
    return RankFailure(rank, host, exitcode, step, log)


def context(tmp_path: Path, room: Room = ROOM, latest: str | None = "phase1-step0000010",
            faults: HostFaults = NO_RATE) -> FaultContext:
    folder = tmp_path / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    if latest:
        (folder / "latest").write_text(latest + "\n")
    return FaultContext("job-1", 3, tmp_path, folder, "./launch.sh pretrain --config run.json", room, faults)


def history(tmp_path: Path) -> FaultHistory:
    return FaultHistory(tmp_path / "logs" / "faults")


def test_the_same_start_up_failure_on_one_host_is_a_drop_before_it_is_a_bug(tmp_path: Path) -> None:
    """The review's case: a GPU that fails the same way at each start (torch's own NCCL text for a CUDA error),
    judged by the agent of its host. With a node to spare the second is a drop, not 'the same failure again'."""
    log = write_rank_log(tmp_path / "rank-1.log", "nccl_unhandled_cuda_error")
    first = judge(failure(log), 0, context(tmp_path), history(tmp_path))
    assert first.restarts and not first.drop and "(restart 1 of 3)" in first.line
    second = judge(failure(log), 1, context(tmp_path), history(tmp_path))
    assert second.drop and second.restarts and second.exit_status == 1, second
    assert second.line.startswith("fault: node n2 dropped: rank 1 (host n2) exited with status 1 during phase1 "
                                  "set-up: the same failure as at the start before, on this host, with no newer "
                                  "checkpoint; carrying on with 2 node(s) (--nodes 2:3), from checkpoint "
                                  "phase1-step0000010; log: "), second.line
    # the attempt the drop ended spends no restart: the next fault elsewhere is restart 2 of 3, not 3 of 3
    other = write_rank_log(tmp_path / "rank-0.log", "culprit_index_error")
    assert "(restart 2 of 3)" in judge(failure(other, host="n1", rank=0), 2, context(tmp_path),
                                       history(tmp_path)).line


def test_without_a_node_to_spare_the_same_failure_stays_a_bug(tmp_path: Path) -> None:
    log = write_rank_log(tmp_path / "rank-1.log", "nccl_unhandled_cuda_error")
    for room in (Room(2, 2, 3), Room(2, 2, 2), Room()):  # MIN nodes left; --nodes N; one machine
        folder = tmp_path / f"{room.nodes}-{room.low}-{room.high}"
        judge(failure(log), 0, context(folder, room), history(folder))
        second = judge(failure(log), 1, context(folder, room), history(folder))
        assert not second.drop and not second.restarts and "the same failure as the last one" in second.line


def test_a_host_that_fails_at_two_starts_or_first_steps_after_a_resume_is_dropped(tmp_path: Path) -> None:
    """Different errors, both at the start of a process (the first step after resuming from step 10 counts); a
    victim's record (its rank lost its peer) never counts."""
    assert at_start("phase1 step 11", "phase1-step0000010") and at_start(None, None) and at_start("start-up", "x")
    assert not at_start("phase1 step 12", "phase1-step0000010") and at_start("phase2 step 1", "phase1-step0000040")
    assert not at_start("phase1 step 11", None) and at_start("phase1 step 1", None)
    victim = write_rank_log(tmp_path / "victim.log", "gloo_allreduce_peer_killed")
    for restart in range(2):
        assert not judge(failure(victim, step="phase1 step 11"), restart, context(tmp_path), history(tmp_path)).drop
    own = write_rank_log(tmp_path / "own.log", "culprit_index_error")
    assert not judge(failure(own, step="phase1 step 11"), 2, context(tmp_path), history(tmp_path)).drop
    cuda = write_rank_log(tmp_path / "cuda.log", "nccl_unhandled_cuda_error")
    dropped = judge(failure(cuda, step="start-up"), 3, context(tmp_path), history(tmp_path))
    assert dropped.drop and "its rank failed at 2 starts with no newer checkpoint between" in dropped.line
    # after progress (a newer checkpoint) the count starts again; a failure mid-run is no start
    later = tmp_path / "later"
    judge(failure(own, step="phase1 step 11"), 0, context(later), history(later))
    assert not judge(failure(cuda, step="phase1 step 21"), 1, context(later, latest="phase1-step0000020"),
                     history(later)).drop
    assert not judge(failure(cuda, step="phase1 step 23"), 2, context(later, latest="phase1-step0000020"),
                     history(later)).drop


def test_a_host_past_its_fault_rate_leaves_the_job_whatever_the_progress(tmp_path: Path) -> None:
    """run.host_fault_limit=3 in run.host_fault_hours=6: a host's own faults mid-run, each after a newer checkpoint
    (the budget refills at each), the third drops it; faults older than the window, another host's and a victim's
    do not count."""
    rate = HostFaults(limit=3, hours=6.0)
    own = write_rank_log(tmp_path / "own.log", "culprit_index_error")
    victim = write_rank_log(tmp_path / "victim.log", "gloo_allreduce_peer_killed")
    past = history(tmp_path)
    old = judge(failure(own, step="phase1 step 5"), 0, context(tmp_path, latest=None, faults=rate),
                history(tmp_path / "scratch"))
    past.add(dataclasses.replace(old, time=time.time() - 7 * 3600))  # a fault of 7 h ago: outside the window
    steps = [("n2", own, 15, 10), ("n1", own, 25, 20), ("n2", victim, 35, 30), ("n2", own, 45, 40)]
    for restart, (host, log, step, latest) in enumerate(steps, start=1):
        record = judge(failure(log, host=host, step=f"phase1 step {step}"), restart,
                       context(tmp_path, latest=f"phase1-step{latest:07d}", faults=rate), past)
        assert not record.drop and "(restart 1 of 3)" in record.line, record.line  # progress refills the budget
    third = judge(failure(own, step="phase1 step 55"), 5,
                  context(tmp_path, latest="phase1-step0000050", faults=rate), past)
    assert third.drop and "3 faults of its own in 6 h (run.host_fault_limit=3, run.host_fault_hours=6)" in third.line
    assert not judge(failure(own, step="phase1 step 55"), 6,  # no node to spare: restarted as before
                     context(tmp_path, room=Room(2, 2, 3), latest="phase1-step0000050", faults=rate), past).drop


def test_a_slow_hosts_eviction_drops_it_and_costs_no_restart(tmp_path: Path) -> None:
    """Every rank exits SLOW_EVICT_EXIT after the checkpoint; the slow rank's log names its host. Its agent drops
    it; the other node restarts (no restart spent). Without room it stays: a restart, never 'a bug', however often."""
    slow = tmp_path / "slow.log"
    slow.write_text(f"warning: rank 1 (host n2) is 31 % slower than the median\n{EVICT_PREFIX}n2\n")
    other = tmp_path / "other.log"
    other.write_text("checkpoint saved\n")
    dropped = judge(failure(slow, exitcode=SLOW_EVICT_EXIT, step="phase1 step 60"), 0,
                    context(tmp_path, latest="phase1-step0000060"), history(tmp_path))
    assert dropped.drop and dropped.kind == "slow" and dropped.line.startswith(
        "fault: node n2 dropped: rank 1 (host n2) exited with status 5 at phase1 step 60: persistently slow, evicted "
        "by the ranks (run.evict_slow: evicting host n2); carrying on with 2 node(s) (--nodes 2:3)"), dropped.line
    restarted = judge(failure(other, host="n1", rank=0, exitcode=SLOW_EVICT_EXIT, step="phase1 step 60"), 0,
                      context(tmp_path, latest="phase1-step0000060"), history(tmp_path))
    assert restarted.restarts and not restarted.drop and "(no restart spent)" in restarted.line
    kept = tmp_path / "kept"
    for restart in range(5):  # more than run.max_restarts, the same each time: still restarted
        record = judge(failure(slow, exitcode=SLOW_EVICT_EXIT, step="phase1 step 60"), restart,
                       context(kept, room=Room(2, 2, 3), latest="phase1-step0000060"), history(kept))
        assert record.restarts and not record.drop and "no node to spare, it stays" in record.line, record.line
    assert history(kept).spent_since("job-1", "phase1-step0000060", 5) == 0
    # and the other nodes' lines give way to the drop: one line, the dropped host's
    shown: list[str] = []
    lines = FaultLines(type("Out", (), {"write": shown.append, "flush": lambda self: None})(), lambda: 2)
    for node, record in (("n1: ", restarted), ("n2: ", dropped)):
        lines.offer(f"{node}launch.sh: fault record: {record.to_json()}")
    assert shown == [f"n2: launch.sh: {dropped.line}\n"]


class NotedPdsh(Pdsh):
    def __init__(self) -> None:
        super().__init__("bert-job-1")
        self.dropped: list[str] = []

    def drop(self, host: str) -> bool:
        self.dropped.append(host)
        return True


def drop_record(host: str, restart: int = 1) -> FaultRecord:
    return FaultRecord(time.time(), "job", host, restart, "exit", 1, "exited with status 1", "start-up", None, None,
                       True, 1, 4, f"fault: node {host} dropped: ...", drop=True)


def test_a_dropped_node_leaves_the_job_its_agent_ended_the_others_told(tmp_path: Path) -> None:
    transport = NotedPdsh()
    nodes = NodeJob(["n1", "n2", "n3"], 2, transport, [], [])
    told: list[str] = []
    assert nodes.node_dropped(dataclasses.replace(drop_record("n2"), drop=False)) is None  # no drop: nothing
    assert nodes.node_dropped(drop_record("n2"), lambda: told.append("first")) == (NODE_LOST_SIGNAL, ["n1", "n3"])
    assert nodes.lost == ["n2"] and told == ["first"]
    nodes.agents_ended["n2"] = 1  # its agent ended by itself (its own way out leaves the rendezvous at once) ...
    nodes.end_agent("n2", 0.5)
    assert transport.dropped == []  # ... so the transport does not kill it
    nodes.end_agent("n3", 0.5)  # an agent that does not end by itself is ended through the transport
    assert transport.dropped == ["n3"]
    assert nodes.node_ended(SessionEnd("n2", 1)) is None  # its agent's end is no second line
    # a second node dropped at once, with no room left for it: the job stops, one line
    assert nodes.node_dropped(drop_record("n3")) == (signal.SIGTERM, ["n1"]) and nodes.failed


def test_under_slurm_a_dropped_host_is_left_out_of_the_jobs_requeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "run.json"
    config.write_text('{"run": {"dir": "%s"}}' % (tmp_path / "run"))
    assert run_dir_of(["--config", str(config)]) == tmp_path / "run"
    assert run_dir_of([f"--config={config}", "--run.dir", "elsewhere"]) == Path("elsewhere")
    srun = Srun("bert-job-1", "77", 1)
    srun.drop = lambda host: True  # type: ignore[method-assign] # the overlapping step is run by test_slurm_faults
    nodes = NodeJob(["vm-1", "vm-2"], 1, srun, [], [], run_dir=tmp_path / "run", slurm_job="77")
    assert nodes.node_dropped(drop_record("vm-2")) == (NODE_LOST_SIGNAL, ["vm-1"])
    assert excluded(tmp_path / "run", "77") == {"vm-2": "fault: node vm-2 dropped: ..."}
    assert excluded(tmp_path / "run", "78") == {}  # another job starts from its whole allocation
    monkeypatch.setenv("SLURM_JOB_NODELIST", "vm-1,vm-2")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    hosts, note = slurm_hosts(2, 1, excluded(tmp_path / "run", "77"))
    assert hosts == ["vm-1"] and note.startswith("warning: node(s) left out, this job (SLURM job 77) dropped them "
                                                 "before: vm-2 (fault: node vm-2 dropped: ...); starting on 1")
    assert "--exclude=vm-2" in Srun("m", "77", 1, excluded=["vm-2"]).command(hosts, [], [], "again")
    with pytest.raises(Exception, match="without the node"):
        slurm_hosts(2, 2, excluded(tmp_path / "run", "77"))


def test_the_ranks_are_told_how_many_nodes_may_leave_now(monkeypatch: pytest.MonkeyPatch) -> None:
    class Handler:
        def next_rendezvous(self) -> object:
            return type("Info", (), {"world_size": 3})()

    monkeypatch.delenv(NODES_SPARE_ENV, raising=False)
    told: list[int] = []  # and nodes.py is told when this agent waits, then the round's size (joins.py)
    handler = telling_rounds(Handler(), 2, 4, told.append)
    assert os.environ[NODES_SPARE_ENV] == "0"  # before any round
    handler.next_rendezvous()
    assert os.environ[NODES_SPARE_ENV] == "1" and told == [0, 3]
    telling_rounds(Handler(), 3, 3).next_rendezvous()  # --nodes N: none
    assert os.environ[NODES_SPARE_ENV] == "0"


def test_a_node_that_leaves_the_job_leaves_the_rendezvous_open_to_the_others() -> None:
    """agent_end.leave on torch's real c10d rendezvous: out of the round's participants at once (the others' next
    round does not wait for its heartbeats to lapse), the rendezvous not closed (closing it would end every node)."""
    params = RendezvousParameters("c10d", f"127.0.0.1:{free_port()}", "bert-job-leave", 1, 2, is_host=True,
                                  last_call_timeout=1, join_timeout=60)
    handler = get_rendezvous_handler(params)
    assert handler.next_rendezvous().world_size == 1
    assert len(handler._state_holder.state.participants) == 1
    leave(handler)
    handler._state_holder.sync()
    assert handler._state_holder.state.participants == {} and not handler.is_closed()
