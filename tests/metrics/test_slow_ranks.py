"""Fail-slow detection (pretrain/metrics/slow_ranks.py): the verdict from the ranks' gathered medians, the forward
clock on a real module, the stop a slow rank's eviction asks for; then one launch of 2 CPU ranks (gloo, ZeRO-2) with
a rank planted 30 % slower from a known step (named within the next window, evicted when a spare node is said to
exist: a checkpoint, every rank exits 5 and the line names the host) and one 5 % slower (named by nothing).
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest
import torch

from pretrain.distributed.stop_request import StopRequest
from pretrain.errors import EVICT_PREFIX, SLOW_EVICT_EXIT
from pretrain.metrics.slow_rank_rule import RankTimes, judge
from pretrain.metrics.slow_ranks import RANK_TAG, RATIO_TAG, ForwardClock, SlowRanks
from tests.support.launching import run_ranks
from tests.support.pretrain_fixtures import build_shards, step_records, tiny_run_config

SCRIPT = Path(__file__).with_name("slow_rank_ranks.py")


def times(*totals: float) -> list[RankTimes]:
    return [RankTimes(f"node{rank}", total * 0.9, total * 0.1, total) for rank, total in enumerate(totals)]


def test_the_slowest_rank_is_judged_against_the_median_of_its_peers() -> None:
    """Two ranks: 1.3x its one peer is 1.3, not 1.3 / 1.15 against the median of both (which would hide it)."""
    verdict = judge(times(0.10, 0.13), 0.20, 50)
    assert verdict is not None and verdict.slow and verdict.rank == 1 and verdict.ratio == pytest.approx(1.3)
    assert verdict.peers == pytest.approx(0.10)
    line = verdict.line()
    assert line.startswith("slow rank: rank 1 (host node1) took 130.0 ms per step against its peers' median 100.0 ms")
    assert "1.30x" in line and "of its last 50 steps" in line
    quiet = judge(times(0.10, 0.105), 0.20, 50)
    assert quiet is not None and not quiet.slow and quiet.ratio == pytest.approx(1.05)
    many = judge(times(0.10, 0.11, 0.09, 0.125, 0.10, 0.10, 0.10, 0.10), 0.20, 50)  # 1.25x the others' median
    assert many is not None and many.slow and many.rank == 3
    assert judge(times(0.10), 0.20, 50) is None and judge(times(0.0, 0.0), 0.20, 50) is None


def test_the_forward_clock_counts_training_forwards_only_and_each_once() -> None:
    model = torch.nn.Linear(4, 4)
    clock = ForwardClock(model)
    model(torch.ones(2, 4))
    model(torch.ones(2, 4))
    assert len(clock.spans) == 2 and clock.take() > 0 and clock.take() == 0.0
    model.eval()
    model(torch.ones(2, 4))  # validation is no step's time
    assert clock.spans == []
    clock.close()
    model.train()
    model(torch.ones(2, 4))
    assert clock.spans == []


def test_leaving_is_a_stop_with_an_exit_status_unless_a_signal_came_first() -> None:
    request = StopRequest()
    request.leave("slow rank 1 (host n1) leaves the job", SLOW_EVICT_EXIT)
    assert (request.signal_name, request.exit_status) == ("slow rank 1 (host n1) leaves the job", SLOW_EVICT_EXIT)
    signalled = StopRequest()
    signalled._handle(signal.SIGTERM, None)
    signalled.leave("slow rank 1 (host n1) leaves the job", SLOW_EVICT_EXIT)
    assert (signalled.signal_name, signalled.exit_status) == ("SIGTERM", 0)  # a time-limit stop still requeues


def test_one_rank_compares_nothing() -> None:
    """Without a process group (or on one rank) the monitor times nothing and logs nothing."""
    monitor = SlowRanks()
    monitor.attach(type("Engine", (), {"module": torch.nn.Linear(2, 2)})())
    assert monitor.clock is None and monitor.values(None) == {}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("slow_ranks")
    tiny_run_config(work / "run.json", build_shards(work / "shards"), work / "unused")
    done = run_ranks(SCRIPT, [str(work), "named", "evict"], num_ranks=2, timeout=600)
    (work / "ranks.log").write_text(done.stdout + done.stderr)
    return work


def ratios(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Step -> (health/slowest_rank_ratio, health/slowest_rank) where the window's comparison was logged."""
    return {step: (record[RATIO_TAG], record[RANK_TAG]) for (_, step), record in step_records(run_dir).items()
            if RATIO_TAG in record}


@pytest.mark.multirank
def test_a_rank_30_percent_slower_is_named_within_a_window_and_5_percent_is_not(launched: Path) -> None:
    """Windows of 4 steps: rank 1 is 5 % slower in the first (steps 1-4: named by nothing, its ratio under the
    threshold), 30 % from step 5 (SLOW_FROM, 0-based 4) on: named by the window of steps 5-8 and again by 9-12.
    Without a spare node it is kept and the run ends well."""
    log = (launched / "ranks.log").read_text()
    named = ratios(launched / "named")
    assert sorted(named) == [4, 8, 12], named
    assert named[4][0] < 1.15 and all(named[s][0] > 1.15 and named[s][1] == 1 for s in (8, 12)), named
    lines = [line for line in log.splitlines() if line.startswith("slow rank: ")]
    assert len(lines) == 3, log  # the two of `named`, the one of `evict` (at its step 8)
    assert all(line.startswith("slow rank: rank 1 (host ") and "of its last 4 steps" in line for line in lines), log
    assert sum("no spare node (BERT_DS_NODES_SPARE), kept" in line for line in lines) == 2, log
    assert json.loads((launched / "named.rank0.json").read_text()) == 0
    assert (launched / "named" / "checkpoints" / "phase1-step0000012" / "PHASE_END").exists()


@pytest.mark.multirank
def test_with_a_spare_node_the_slow_rank_leaves_after_a_checkpoint(launched: Path) -> None:
    """Named at step 8, every rank stops at step 9 with a checkpoint (the stop rides that step's all-reduce, as a
    signal's does), the slow rank's log names its host, and both ranks exit SLOW_EVICT_EXIT."""
    log = (launched / "ranks.log").read_text()
    assert [json.loads((launched / f"evict.rank{r}.json").read_text()) for r in (0, 1)] == [SLOW_EVICT_EXIT] * 2
    latest = (launched / "evict" / "checkpoints" / "latest").read_text()
    assert latest == "phase1-step0000009"
    state = json.loads((launched / "evict" / "checkpoints" / latest / "trainer_state.json").read_text())
    assert state["step"] == 9 and not state["complete"]
    evicting = [line for line in log.splitlines() if EVICT_PREFIX in line]
    assert len(evicting) == 1 and f"{EVICT_PREFIX}{socket.gethostname()} (rank 1 took " in evicting[0], log
    assert (f"stopped (slow rank 1 (host {socket.gethostname()}) leaves the job) at phase1 step 9; checkpoint "
            "phase1-step0000009 written. The launcher restarts from it without the evicted host.") in log
    assert sorted(ratios(launched / "evict")) == [4, 8]
