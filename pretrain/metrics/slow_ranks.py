"""Fail-slow detection: each rank's step time against its peers', so that one slow GPU is named, not just felt.

A synchronous job runs at its slowest rank's pace. A throttled GPU or a degraded host makes every rank's step slower,
and since the others wait for it in the gradient all-reduce, every rank's *whole* step takes the same time: no timer
fires and rank 0's step time only says "slower". What does differ between ranks is the time before the all-reduce:
a rank's own work. This monitor times, per rank and per optimizer step,

    forward   the model's forward passes of the step's micro-batches (training mode only; validation is left out):
              pure compute at ZeRO stages 0-2, with no collective inside. The backward is not timed: DeepSpeed
              reduces gradients inside it (ZeRO's bucket hooks), so its time holds the wait for the slowest peer.
              On a CPU the wall clock around the call; on a GPU two CUDA events (no host sync: they are read after
              the step's own host read, when they have completed).
    data      the time the step waited for its micro-batches (perf/data_wait_s, pretrain/step_feed.py): a rank on
              a slow disk or a starved loader is slow too.

Every `run.slow_rank_window_steps` steps each rank takes the median of its per-step `forward + data` over the window
(a median: a rank must be slow in most steps of the window, so one hiccup or a checkpoint step is not a verdict), and
the ranks gather those medians (one all-gather of a few numbers per window). Each rank's ratio is its median over the
median of its *peers'* (the others': with two ranks the median of all would halve the gap). The slowest ratio is
logged as health/slowest_rank_ratio; above 1 + `run.slow_rank_threshold` rank 0 names the rank in one line.

With `run.evict_slow` and a spare node (the launcher's agent sets BERT_DS_NODES_SPARE), every rank reaches the same
verdict from the same gathered numbers and asks for a stop (pretrain/distributed/stop_request.py `leave`): the loop
checkpoints at the next step as for a signal, the slow rank prints `evicting host HOST (...)` (EVICT_PREFIX, the host then a space) on its log
and every rank exits SLOW_EVICT_EXIT (pretrain/errors.py), for the launcher to restart without that host. Without a
spare node the rank is only named: leaving would shrink the job, which costs more than the slow rank.
"""

from __future__ import annotations

import sys
import time
from dataclasses import astuple
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from pretrain.distributed.json_collectives import all_gather_json
from pretrain.distributed.stop_request import StopRequest
from pretrain.errors import EVICT_PREFIX, NODES_SPARE_ENV, SLOW_EVICT_EXIT
from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.metrics.slow_rank_rule import (
    RankTimes,
    SlowRankSection,
    SlowVerdict,
    judge,
    node_name,
    spare_nodes,
)
from pretrain.step_stats import StepResult

RATIO_TAG, RANK_TAG = "health/slowest_rank_ratio", "health/slowest_rank"


class ForwardClock:
    """The seconds this rank's model spent in training-mode forward passes since the last `take`: the wall clock
    around each call on a CPU (a forward returns when done), CUDA events on a GPU (queued, never waited for)."""

    def __init__(self, module: torch.nn.Module) -> None:
        device = next(module.parameters()).device
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self._start: Any = None
        self.handles = [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        self._start = self._now() if module.training else None

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._start is not None:
            self.spans.append((self._start, self._now()))
            self._start = None

    def take(self) -> float:
        """Seconds of the spans so far, then forgets them. On a GPU called after the step's host read: its events
        have completed, so reading them waits for nothing."""
        spans, self.spans = self.spans, []
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in spans) / 1e3
        return sum(end - start for start, end in spans)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class SlowRanks(StepMonitor):
    """Each rank's step time (forward + data wait) against its peers' every window (module docstring).

    Tags:
        health/slowest_rank_ratio   [window] the slowest rank's median step time over its peers' median (1.0: even)
        health/slowest_rank         [window] which rank that is
    """

    def __init__(self, settings: SlowRankSection | None = None) -> None:
        self.settings = settings or SlowRankSection()
        self.clock: ForwardClock | None = None
        self.forward: list[float] = []  # this window's seconds per step, one entry per step
        self.data: list[float] = []
        self.leaving = False  # this job already asked to stop for a slow rank

    def attach(self, engine: Any) -> None:
        self.close()
        self.forward, self.data = [], []  # this trainer's own (attach_all hands each trainer a shallow copy)
        if self.settings.slow_rank_window_steps > 0 and dist.is_initialized() and dist.get_world_size() > 1:
            self.clock = ForwardClock(engine.module)

    def values(self, result: StepResult) -> dict[str, float]:
        if self.clock is None:
            return {}
        self.forward.append(self.clock.take())
        self.data.append(float(result.values.get("perf/data_wait_s", 0.0)))
        if len(self.forward) < self.settings.slow_rank_window_steps:
            return {}
        mine = RankTimes(node_name(), median(self.forward), median(self.data),
                         median(f + d for f, d in zip(self.forward, self.data, strict=True)))
        window = len(self.forward)
        self.forward, self.data = [], []
        times = [RankTimes(*each) for each in all_gather_json(astuple(mine))]
        verdict = judge(times, self.settings.slow_rank_threshold, window)
        if verdict is None:
            return {}
        if verdict.slow:
            self.act(verdict)
        return {RATIO_TAG: verdict.ratio, RANK_TAG: float(verdict.rank)}

    def act(self, verdict: SlowVerdict) -> None:
        """Name the slow rank (rank 0), and with run.evict_slow and a spare node, leave: every rank asks for the
        stop (they all hold the same verdict), the slow rank says which host goes."""
        rank = dist.get_rank()
        evicting = self.settings.evict_slow and spare_nodes() > 0
        if rank == 0:
            why = ("evicting it (run.evict_slow, a spare node)" if evicting else
                   "run.evict_slow is off" if not self.settings.evict_slow else f"no spare node ({NODES_SPARE_ENV}), kept")
            print(f"{verdict.line()}; run.slow_rank_threshold={self.settings.slow_rank_threshold}: {why}", flush=True)
        if not evicting or self.leaving:
            return
        self.leaving = True
        if rank == verdict.rank:  # the rank's log (stderr under the agent) carries the line the launcher reads
            print(f"{EVICT_PREFIX}{verdict.times.host} (rank {rank} took {verdict.ratio:.2f}x its peers' median step "
                  f"time); checkpointing, then exit {SLOW_EVICT_EXIT}", file=sys.stderr, flush=True)
        StopRequest.current().leave(f"slow rank {verdict.rank} (host {verdict.times.host}) leaves the job",
                                    SLOW_EVICT_EXIT)

    def close(self) -> None:
        if self.clock is not None:
            self.clock.close()
            self.clock = None
