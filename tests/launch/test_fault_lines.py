"""pretrain/launch/faults.py: which failure is named, what the line says, when restarts stop, and the fault record every
node writes and reads, on real files (a run folder's `latest`, a rank's log, the shared history) and real processes
(/proc states, the agent's timer server). The end-to-end runs are tests/launch/test_faults.py and test_hostfile.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.distributed.step_watch import RUN_ENDED_PREFIX, TEARDOWN, TIMER_FILE_ENV, tell_run_ended
from pretrain.launch.fault_records import FaultLines
from pretrain.launch.faults import (
    RECORD_PREFIX,
    AgentEnd,
    FaultContext,
    FaultHistory,
    FaultRecord,
    RankFailure,
    judge,
    primary_failure,
)
from pretrain.launch.processes import process_state
from tests.support.fault_texts import fault_text, write_rank_log
from tests.support.paths import REPO_ROOT


def failure(tmp_path: Path, rank: int = 1, exitcode: int = -9, step: str | None = "phase1 step 12",
            hang: str | None = None, **more: object) -> RankFailure:
    return RankFailure(rank, "node7", exitcode, step, tmp_path / f"rank-{rank}.log", hang, **more)  # type: ignore[arg-type]


def context(tmp_path: Path, max_restarts: int = 3, latest: str | None = "phase1-step0000010", job: str = "job-1",
            checkpoints: Path | None = None) -> FaultContext:
    folder = checkpoints or tmp_path / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    if latest:
        (folder / "latest").write_text(latest + "\n")
    return FaultContext(job, max_restarts, tmp_path, folder, "./launch.sh pretrain --config run.json")


def history(tmp_path: Path) -> FaultHistory:
    return FaultHistory(tmp_path / "logs" / "faults")


def test_the_rank_that_failed_first_is_named_not_the_ones_that_followed(tmp_path: Path) -> None:
    write_rank_log(tmp_path / "rank-0.log", "culprit_index_error_peer")  # gloo's text: its all-reduce lost the peer
    peer = failure(tmp_path, rank=0, exitcode=1)
    stopped_by_agent = failure(tmp_path, rank=2, exitcode=-signal.SIGTERM)
    aborted = failure(tmp_path, rank=4, exitcode=-signal.SIGABRT)  # NCCL's watchdog ended it: a victim
    killed = failure(tmp_path, rank=3, exitcode=-signal.SIGKILL)
    assert primary_failure([peer, stopped_by_agent, aborted, killed]) is killed
    assert primary_failure([aborted, stopped_by_agent, peer]) is peer  # two victims: only the peer's log tells when
    silent = failure(tmp_path, rank=6, exitcode=1)  # exit 1, no exception in its log: nothing says a peer is gone
    assert primary_failure([peer, silent]) is silent
    assert primary_failure([stopped_by_agent, aborted]) is aborted
    lost = failure(tmp_path, rank=0, exitcode=-signal.SIGKILL, node_lost=True)  # its agent ended it: a node was lost
    assert primary_failure([lost, aborted]) is aborted and "a node of the job was lost" in lost.cause
    waiting = failure(tmp_path, rank=0, hang="made no progress in 10 min (running but not progressing; x)")
    frozen = failure(tmp_path, rank=1, hang="made no progress in 10 min (stopped by SIGSTOP; x)")
    assert primary_failure([waiting, killed, frozen]) is frozen
    assert primary_failure([waiting, killed]) is waiting


def test_a_fault_restarts_with_one_line_until_the_budget_is_spent(tmp_path: Path) -> None:
    record = judge(failure(tmp_path), 0, context(tmp_path), history(tmp_path))
    assert record.restarts and record.line == (
        f"fault: rank 1 (host node7) died of SIGKILL at phase1 step 12; restarting from checkpoint "
        f"phase1-step0000010 (restart 1 of 3); log: {tmp_path / 'rank-1.log'}")
    for restart, code in ((1, -signal.SIGSEGV), (2, -signal.SIGBUS)):  # other faults, no checkpoint in between
        assert judge(failure(tmp_path, exitcode=code), restart, context(tmp_path), history(tmp_path)).restarts
    later = failure(tmp_path, exitcode=1, step="phase1 step 15")
    record = judge(later, 3, context(tmp_path), history(tmp_path))
    assert not record.restarts and record.exit_status == 1
    assert record.line.startswith("error: rank 1 (host node7) exited with status 1 at phase1 step 15; no restart "
                                  "left (run.max_restarts=3), all spent since that checkpoint; last checkpoint "
                                  "phase1-step0000010; log: ")
    assert record.line.endswith("; resume with: ./launch.sh pretrain --config run.json")
    fresh = judge(failure(tmp_path, step="start-up"), 0, context(tmp_path / "new", latest=None),
                  history(tmp_path / "new"))
    assert "during start-up; restarting from the start (no checkpoint yet) (restart 1 of 3)" in fresh.line


def test_the_budget_counts_the_faults_since_the_last_checkpoint_so_a_long_job_outlives_it(tmp_path: Path) -> None:
    """run.max_restarts=3 and eight faults: four with a checkpoint committed between each (progress starts the count
    again), then four at one checkpoint, each attempt told by two nodes (one restart spent per attempt, not per
    node's record): the fourth fault with no progress ends the job."""
    shared = history(tmp_path)
    tags = ["phase1-step0000004", "phase1-step0000008", "phase1-step0000012", "phase1-step0000016"]
    for restart, tag in enumerate(tags):
        record = judge(failure(tmp_path, step=f"phase1 step {restart * 4 + 6}"), restart,
                       context(tmp_path, latest=tag), shared)
        assert record.restarts and f"from checkpoint {tag} (restart 1 of 3)" in record.line, record.line
    causes = [-signal.SIGKILL, -signal.SIGSEGV, -signal.SIGBUS, -signal.SIGILL]
    for restart, code in enumerate(causes, start=len(tags)):
        peer = judge(failure(tmp_path, rank=0, exitcode=-signal.SIGABRT), restart, context(tmp_path), shared)
        own = judge(failure(tmp_path, exitcode=code), restart, context(tmp_path), shared)
        assert peer.restarts == own.restarts  # every node reaches the same verdict
        if restart < len(tags) + 3:
            assert own.restarts and f"(restart {restart - len(tags) + 1} of 3)" in own.line, own.line
    assert not own.restarts and "no restart left (run.max_restarts=3), all spent since that checkpoint" in own.line


def node_line(host: str, record: FaultRecord) -> str:
    return f"{host}: {RECORD_PREFIX}{record.to_json()}\n"  # as pdsh relays it


def test_a_victims_record_never_ends_the_job_and_the_line_names_the_culprit(tmp_path: Path) -> None:
    """The review's case: node A fails twice during phase1 set-up, for two causes (SIGKILL, then its own error); node
    B's rank loses its peer both times with torch's multi-line NCCL text. Before, B judged "the same failure again"
    and its verdict, naming B's rank, ended the job (tests/launch/test_fault_texts.py: every victim text)."""
    shared, a, b = history(tmp_path), tmp_path / "a", tmp_path / "b"
    write_rank_log(b / "rank-2.log", "nccl_remote_error")
    out = io.StringIO()
    lines = FaultLines(out, nodes_running=lambda: 2, settle_s=60)
    for restart, code in enumerate([-signal.SIGKILL, 1]):
        write_rank_log(a / "rank-0.log", "culprit_index_error")
        culprit = RankFailure(0, "nodeA", code, "phase1 set-up", a / "rank-0.log")
        victim = RankFailure(2, "nodeB", 1, "phase1 set-up", b / "rank-2.log")
        told = judge(victim, restart, context(tmp_path, latest=None), shared)  # the victim's node judges first
        assert told.restarts and told.victim, told.line
        lines.offer(node_line("nodeB", told))
        lines.offer(node_line("nodeA", judge(culprit, restart, context(tmp_path, latest=None), shared)))
    shown = out.getvalue().splitlines()
    assert [line.split(";")[0] for line in shown] == [
        "nodeA: launch.sh: fault: rank 0 (host nodeA) died of SIGKILL during phase1 set-up",
        "nodeA: launch.sh: fault: rank 0 (host nodeA) exited with status 1 during phase1 set-up"], shown
    assert "(restart 2 of 3)" in shown[1]


def test_a_culprits_exit_1_is_named_before_a_sigabrt_victim_and_before_an_earlier_lower_rank(tmp_path: Path) -> None:
    """Rank 7 exits 1 on an error of its own; rank 3, its peer, is aborted by NCCL's watchdog (SIGABRT), its log
    written earlier: the culprit is named, on one node (primary_failure) and across nodes (the records, FaultLines)."""
    write_rank_log(tmp_path / "rank-7.log", "culprit_index_error")
    write_rank_log(tmp_path / "rank-3.log", "nccl_watchdog_timeout_sigabrt", written=1000.0)
    culprit = failure(tmp_path, rank=7, exitcode=1)
    aborted = failure(tmp_path, rank=3, exitcode=-signal.SIGABRT)
    assert primary_failure([aborted, culprit]) is culprit
    write_rank_log(tmp_path / "rank-5.log", "nccl_unhandled_cuda_error")  # its own GPU: NCCL's error, no lost peer
    assert primary_failure([aborted, failure(tmp_path, rank=5, exitcode=1)]).rank == 5
    out = io.StringIO()
    lines = FaultLines(out, nodes_running=lambda: 2, settle_s=60)
    lines.offer(node_line("n0", judge(aborted, 0, context(tmp_path), history(tmp_path))))
    lines.offer(node_line("n1", judge(culprit, 0, context(tmp_path), history(tmp_path))))
    assert out.getvalue().startswith("n1: launch.sh: fault: rank 7 (host node7) exited with status 1 at phase1 "), \
        out.getvalue()


def test_of_two_equally_telling_failures_the_earlier_is_named_not_the_lower_rank(tmp_path: Path) -> None:
    for rank, written in ((1, 2000.0), (5, 1000.0)):  # rank 5 wrote its traceback first
        (tmp_path / f"rank-{rank}.log").write_text(f"Traceback (most recent call last):\nRuntimeError: bug {rank}\n")
        os.utime(tmp_path / f"rank-{rank}.log", (written, written))
    late, early = failure(tmp_path, rank=1, exitcode=1), failure(tmp_path, rank=5, exitcode=1)
    assert primary_failure([late, early]) is early
    # torch noticed rank 1's end first (whole seconds): that bounds its time, and it is then the earlier
    noticed_first = failure(tmp_path, rank=1, exitcode=1, noticed=500.0)
    assert primary_failure([early, noticed_first]) is noticed_first
    out = io.StringIO()
    lines = FaultLines(out, nodes_running=lambda: 2, settle_s=60)
    for host, each in (("n0", late), ("n1", early)):
        lines.offer(node_line(host, judge(each, 0, context(tmp_path), history(tmp_path))))
    assert out.getvalue().startswith("n1: launch.sh: fault: rank 5 "), out.getvalue()


def test_every_judged_fault_is_kept_with_its_time_kind_restart_and_checkpoint(tmp_path: Path) -> None:
    """The data a report needs to cost the faults: one record per judged fault, every node's, in the run folder."""
    before = time.time()
    judge(failure(tmp_path), 0, context(tmp_path), history(tmp_path))
    judge(failure(tmp_path, rank=0, exitcode=1), 0, context(tmp_path), history(tmp_path))  # the other node's word
    hang = failure(tmp_path, step="phase1 step 20", hang="made no progress in 10 min (stopped by SIGSTOP; x)")
    judge(hang, 1, context(tmp_path, latest="phase1-step0000020"), history(tmp_path))
    kept = history(tmp_path).records()
    assert [(r.restart, r.kind, r.rank, r.checkpoint) for r in kept] == [
        (0, "signal", 1, "phase1-step0000010"), (0, "exit", 0, "phase1-step0000010"),
        (1, "hang", 1, "phase1-step0000020")]
    assert all(before <= r.time <= time.time() and r.job == "job-1" for r in kept)
    assert FaultRecord.from_json(kept[2].to_json()) == kept[2]


def test_the_same_failure_again_on_any_node_with_no_newer_checkpoint_stops_the_restarts(tmp_path: Path) -> None:
    write_rank_log(tmp_path / "rank-1.log", "culprit_index_error")
    assert judge(failure(tmp_path, exitcode=1), 0, context(tmp_path), history(tmp_path)).restarts
    # the next attempt, judged by another node (the records are shared through the run folder): the same kind,
    # cause, step and error line with no newer checkpoint since
    again = judge(failure(tmp_path, exitcode=1), 1, context(tmp_path), history(tmp_path))
    assert not again.restarts and "a bug, not a fault" in again.line and "resume with:" in again.line
    # a newer checkpoint in between is progress: the same step number is a new fault
    assert judge(failure(tmp_path, exitcode=1), 2, context(tmp_path, latest="phase1-step0000012"),
                 history(tmp_path)).restarts


def test_two_unrelated_start_up_failures_are_not_a_bug(tmp_path: Path) -> None:
    """Keyed by cause, not by step alone: a port taken, then a device not yet free, are two faults."""
    write_rank_log(tmp_path / "rank-1.log", "culprit_port_taken")  # torch's DistNetworkError ... EADDRINUSE
    assert judge(failure(tmp_path, exitcode=1, step="start-up"), 0, context(tmp_path, latest=None),
                 history(tmp_path)).restarts
    write_rank_log(tmp_path / "rank-1.log", "culprit_index_error")
    second = judge(failure(tmp_path, exitcode=1, step="start-up"), 1, context(tmp_path, latest=None),
                   history(tmp_path))
    assert second.restarts and "(restart 2 of 3)" in second.line
    killed = judge(failure(tmp_path, step="start-up"), 2, context(tmp_path, latest=None), history(tmp_path))
    assert killed.restarts  # died of SIGKILL: another cause again


def test_nodes_lost_at_the_same_step_twice_are_two_faults(tmp_path: Path) -> None:
    """A lost node is the world's doing: a second one at the same step is no bug of the run's."""
    for restart in (0, 1):
        lost = judge(failure(tmp_path, exitcode=-9, node_lost=True), restart, context(tmp_path), history(tmp_path))
        assert lost.restarts and lost.kind == "node", lost.line


def test_a_config_error_is_its_own_line_once_and_nan_losses_are_not_restarted(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text("Traceback (most recent call last):\n  ...\nconfig error: data.shards: x: sha256 differs\n"
                   "terminate called without an active exception\n")
    record = judge(failure(tmp_path, rank=0, exitcode=2), 0, context(tmp_path), history(tmp_path))
    assert (record.restarts, record.line, record.exit_status) == (
        False, "config error: data.shards: x: sha256 differs", 2)
    nan = judge(failure(tmp_path, rank=0, exitcode=3), 0, context(tmp_path), history(tmp_path))
    assert not nan.restarts and nan.exit_status == 3 and "NaN/inf losses, not restarted" in nan.line


def test_a_save_that_failed_is_told_in_the_ranks_own_words_and_only_space_asks_for_space(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text("checkpoint error: could not write RUN/checkpoints/phase1-step0000004 (rank 0: x.pt: [Errno 5] "
                   "Input/output error); latest still names phase1-step0000002; stopping: remove the cause of that "
                   "error, then rerun the same command (it resumes from there)\n")
    record = judge(failure(tmp_path, rank=0, exitcode=4), 0, context(tmp_path), history(tmp_path))
    assert not record.restarts and record.exit_status == 4
    assert record.line == log.read_text().strip()  # the one line of this fault: the rank's own, right advice included
    log.write_text("")  # nothing of its own in the log (killed mid-save): no advice at all
    silent = judge(failure(tmp_path, rank=0, exitcode=4), 0, context(tmp_path), history(tmp_path))
    assert silent.line.startswith("error: rank 0 (host node7) exited with status 4 at phase1 step 12: a checkpoint or "
                                  "export that could not be written, not restarted; log: ")
    assert "free space" not in silent.line and silent.exit_status == 4


def test_a_codistillation_rank_restarts_from_its_own_groups_checkpoint(tmp_path: Path) -> None:
    """The line names the checkpoint the rank really resumes from: group<g>/checkpoints/... of its run folder."""
    from pretrain.config.load import (
        load_config,  # the agent's judging reads the plug-in's layout (no torch here)
    )
    from pretrain.launch.agent import Judging  # imports torch's elastic agent: only this test needs it

    run = tmp_path / "run"
    config_file = tmp_path / "run.json"
    ds = REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json"
    config_file.write_text(json.dumps({"run": {"dir": str(run), "phases": ["phase1"]}, "data": {"shards": "s"},
                                       "phase1": {"steps": 2, "lr": 1e-3, "batch_size": 8, "micro_batch_size": 4,
                                                  "ds_config": str(ds)},
                                       "codistill": {"enabled": True, "groups": 2}}))
    config = load_config(str(config_file), [])
    (run / "group1" / "checkpoints").mkdir(parents=True)
    (run / "group1" / "checkpoints" / "latest").write_text("phase1-step0000020")
    plain = FaultContext("job", 3, run, config.checkpoint_dir, "again")
    judging = Judging(config, plain, history(tmp_path))
    record = judge(failure(tmp_path, rank=1), 0, judging.context_for(1, 2), judging.history)
    assert "restarting from checkpoint group1/checkpoints/phase1-step0000020 (restart 1 of 3)" in record.line
    assert judging.context_for(0, 2).checkpoint_dir == run / "group0" / "checkpoints"


def test_a_record_and_an_agents_last_word_cross_to_the_launcher_as_one_line_each() -> None:
    record = FaultRecord(1.5, "job", "n2", 0, "signal", 1, "died of SIGKILL", "phase1 step 3", None, None, True, 0, 2,
                         "fault: ...")
    line = f"n2: launch.sh: fault record: {record.to_json()}\n"  # pdsh puts the node in front
    assert FaultRecord.from_line(line) == record and FaultRecord.from_line("n2: done: complete\n") is None
    assert AgentEnd.from_line(f"n2: {AgentEnd('n2', 4).to_line()}\n") == AgentEnd("n2", 4)


def test_process_state_tells_a_stopped_process(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == ""  # gone


def test_the_hang_watch_names_a_frozen_peer_and_ends_both_the_waiting_one_after_its_stacks(tmp_path: Path) -> None:
    """A rank frozen between two steps holds no timer that runs out: its peer, waiting in a collective, times out
    first. The agent's timer server names the frozen one too, with the limit that ran out, asks the waiting one for
    its stacks (the frozen one could answer only if let run on), then kills both."""
    from pretrain.launch.hang_watch import (  # imports torch's timer server: only this test needs it
        HangWatch,
        Limits,
    )

    code = ("import time\nfrom pretrain.distributed.step_watch import dump_stacks_on_signal\n"
            "dump_stacks_on_signal()\nprint('ready', flush=True)\ntime.sleep(60)\n")
    logs = [tmp_path / "frozen.log", tmp_path / "waiting.log"]
    frozen, waiting = (subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log.open("w"),
                                        text=True) for log in logs)
    try:
        for child in (frozen, waiting):
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
        frozen.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(frozen.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        watch = HangWatch(str(tmp_path / "timers"), Limits(hang_s=6.0, startup_s=60.0))
        watch.last_step.update({frozen.pid: "phase1 step 7", waiting.pid: "phase1 step 8"})
        watch.startup.update({frozen.pid: False, waiting.pid: False})
        assert watch._reap_worker(waiting.pid, signal.SIGKILL)
        assert waiting.wait(timeout=10) == -signal.SIGKILL and frozen.wait(timeout=10) == -signal.SIGKILL
        assert watch.hung == {
            waiting.pid: "made no progress in 0.1 min (running but not progressing; run.hang_timeout_minutes)",
            frozen.pid: "made no progress in 0.1 min (stopped by SIGSTOP; run.hang_timeout_minutes)"}
        assert watch.stacks == {waiting.pid}
        assert "most recent call first" in logs[1].read_text() and logs[0].read_text() == ""
    finally:
        for child in (frozen, waiting):
            child.kill()
            child.wait()


def test_a_rank_that_hangs_or_crashes_after_its_run_ended_is_a_warning_never_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished run finishes: a rank that said its run ended (the driver's RUN_ENDED_PREFIX line in its log, under
    the agent) and then hung on its way out (its teardown timer killed it) or crashed there (NCCL's destructors:
    SIGABRT) is one warning line, no restart, status 0, and no fault in the records (goodput counts none). Before,
    it was a fault: a restart, and on several nodes status 1 about ten minutes after training finished."""
    log = tmp_path / "rank-1.log"
    with log.open("w") as stderr, contextlib.redirect_stderr(stderr):
        tell_run_ended("complete")  # the driver's last word: nothing without the agent's timer pipe
        monkeypatch.setenv(TIMER_FILE_ENV, str(tmp_path / "timers"))
        tell_run_ended("complete")  # under the agent its stderr is this log
    assert log.read_text() == f"{RUN_ENDED_PREFIX}complete\n"
    hung = failure(tmp_path, exitcode=-signal.SIGKILL, step=TEARDOWN,
                   hang="made no progress in 10 min (running but not progressing; run.hang_timeout_minutes)")
    record = judge(hung, 0, context(tmp_path), history(tmp_path))
    assert (record.restarts, record.exit_status) == (False, 0)
    assert record.line.startswith("warning: rank 1 (host node7) made no progress in 10 min (running but not "
                                  "progressing; run.hang_timeout_minutes): killed during teardown after its run "
                                  "ended (complete): not restarted, the run's end stands; log: "), record.line
    log.write_text(f"{RUN_ENDED_PREFIX}SIGTERM\nterminate called without an active exception\n")  # after a stop
    aborted = judge(failure(tmp_path, exitcode=-signal.SIGABRT, step="phase1 step 12"), 1, context(tmp_path),
                    history(tmp_path))
    assert (aborted.restarts, aborted.exit_status) == (False, 0) and "run ended (SIGTERM)" in aborted.line
    assert history(tmp_path).records() == []
    assert hung.ended_run == "SIGTERM"  # the agent's stop path reads it: a stop whose runs ended exits 0
    log.write_text(fault_text("culprit_index_error"))  # failed before its run ended: a fault as ever
    assert judge(failure(tmp_path, exitcode=1), 2, context(tmp_path), history(tmp_path)).restarts
    assert failure(tmp_path, exitcode=1).ended_run is None
