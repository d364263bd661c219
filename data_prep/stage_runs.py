"""Who runs which task after the corpus stage: the instance tasks, the scatters and the gathers, all of them (a
single-node build, `merge`) or one node's share (`--num-nodes`), in a pool of W workers; and the barrier a node
waits at between two stages (every marker of the stage before, written by whichever node ran it).

A share is every N-th task of the stage's fixed list (task i goes to node i mod N), so nodes never run the same
task; a task that a node could not run (it was dead, or the barrier gave up) is left to `merge`, which runs
every task without a marker. Whoever runs a task, its bytes are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from data_prep.config import BuildConfig
from data_prep.instance_stage import InstanceSettings, InstanceTask, instance_task_done, make_instances
from data_prep.parallel import Workers
from data_prep.shard_tasks import (
    SplitOrder,
    StageSettings,
    gather_done,
    gather_tasks,
    run_gather,
    run_scatter,
    scatter_jobs,
    scatter_needed,
    split_orders,
    with_rows,
)
from data_prep.work_layout import TOKENS_STAGE, instances_stage, marker_path, scatter_stage

T = TypeVar("T")
POLL_SECONDS = 1.0  # how often a waiting node looks at the markers


@dataclass(frozen=True)
class Share:
    """Node `rank` of `nodes`: task i of a stage is its when i % nodes == rank (one node: every task)."""

    nodes: int = 1
    rank: int = 0

    def of(self, tasks: Sequence[T]) -> list[T]:
        return list(tasks[self.rank :: self.nodes])


EVERY_TASK = Share()


def instance_tasks(cfg: BuildConfig, num_shards: int) -> list[InstanceTask]:
    """Every (input shard, sequence length), shard-major: task i is shard i // L, length i % L."""
    settings = InstanceSettings.of(cfg)
    return [InstanceTask(cfg.out_dir, num_shards, shard, seq_len, cfg.max_predictions()[str(seq_len)], settings)
            for shard in range(num_shards) for seq_len in cfg.seq_lens]


def run_instances(cfg: BuildConfig, num_shards: int, workers: Workers, share: Share = EVERY_TASK) -> None:
    """The share's instance tasks still missing, all lengths in one pool pass so that every worker stays busy."""
    tasks = [t for t in share.of(instance_tasks(cfg, num_shards)) if not instance_task_done(t.out, t.seq_len, t.shard)]
    started = time.perf_counter()
    for _ in workers.map(make_instances, tasks):
        pass
    print(f"stage instances: {time.perf_counter() - started:.1f}s", flush=True)


def run_scatters(settings: StageSettings, orders: dict[tuple[int, str], SplitOrder], workers: Workers,
                 share: Share = EVERY_TASK) -> None:
    """The share's scatters still needed (lengths with a split over one bucket)."""
    jobs = [job for job in share.of(scatter_jobs(settings, orders)) if scatter_needed(job)]
    for _ in workers.map(run_scatter, jobs):
        pass


def run_gathers(settings: StageSettings, orders: dict[tuple[int, str], SplitOrder], workers: Workers,
                share: Share = EVERY_TASK) -> None:
    """The share's gathers still missing, every length and split in one pool pass (W shards at a time)."""
    tasks = (t for t in with_rows(share.of(gather_tasks(settings, orders))) if not gather_done(t))
    for _ in workers.map(run_gather, tasks):
        pass


def run_shard_stage(cfg: BuildConfig, num_shards: int, workers: Workers) -> dict[tuple[int, str], SplitOrder]:
    """Every scatter and gather still missing (every instance task done); returns the orders (for the manifest)."""
    started = time.perf_counter()
    settings = StageSettings.of(cfg, num_shards)
    orders = split_orders(settings)
    run_scatters(settings, orders, workers)
    run_gathers(settings, orders, workers)
    print(f"stage shards: {time.perf_counter() - started:.1f}s", flush=True)
    return orders


def corpus_markers(out: Path, num_shards: int) -> list[Path]:
    return [marker_path(out, TOKENS_STAGE, s) for s in range(num_shards)]


def instance_markers(cfg: BuildConfig, num_shards: int) -> list[Path]:
    return [marker_path(cfg.out_dir, instances_stage(t.seq_len), t.shard) for t in instance_tasks(cfg, num_shards)]


def scatter_markers(settings: StageSettings, orders: dict[tuple[int, str], SplitOrder]) -> list[Path]:
    return [marker_path(settings.out, scatter_stage(job.seq_len), job.shard)
            for job in scatter_jobs(settings, orders) if job.buckets]


def wait_for(markers: list[Path], patience_s: float, what: str,
             sleep: Callable[[float], None] = time.sleep) -> bool:
    """True once every marker exists; False when none appeared for `patience_s` seconds (a node that died, or
    one far behind: its tasks are then left to `merge`). Says what it waits for, and why it stops."""
    missing = [m for m in markers if not m.is_file()]
    if missing:
        print(f"waiting for {len(missing)} {what} task(s) of other nodes (up to {patience_s:g} s without one "
              "finishing)", flush=True)
    last_change = time.monotonic()
    while missing:
        still = [m for m in missing if not m.is_file()]
        if len(still) < len(missing):
            last_change = time.monotonic()
        missing = still
        if missing and time.monotonic() - last_change >= patience_s:
            print(f"{len(missing)} {what} task(s) not finished by other nodes (e.g. {missing[0].name}): stopping "
                  "here; `merge` runs what is left", flush=True)
            return False
        if missing:
            sleep(min(POLL_SECONDS, patience_s))
    return True


def run_node_share(cfg: BuildConfig, num_shards: int, workers: Workers) -> None:
    """After this node's corpus share: its share of the instance tasks once every input shard is tokenized, then
    of the scatters once every instance task is done, then of the gathers once every scatter is done. A barrier
    that gives up (`--node-wait`) leaves the rest to `merge`."""
    share = Share(cfg.num_nodes, cfg.node_rank)
    if not wait_for(corpus_markers(cfg.out_dir, num_shards), cfg.node_wait, "corpus"):
        return
    run_instances(cfg, num_shards, workers, share)
    if not wait_for(instance_markers(cfg, num_shards), cfg.node_wait, "instance"):
        return
    started = time.perf_counter()
    settings = StageSettings.of(cfg, num_shards)
    orders = split_orders(settings)
    run_scatters(settings, orders, workers, share)
    if not wait_for(scatter_markers(settings, orders), cfg.node_wait, "scatter"):
        return
    run_gathers(settings, orders, workers, share)
    print(f"stage shards: {time.perf_counter() - started:.1f}s", flush=True)
