"""Stage 3 as tasks that any process can run: the scatter of each (input shard, length) over one bucket and the
gather of each output shard, each with its marker. The local pool runs them W at a time, each `--num-nodes`
node its share, SLURM one array element each (data_prep/stage_runs.py drives them); `merge` only reads the
gathers' markers into the manifest.

A task needs nothing from the process that planned it: it reads what it needs from the folder (the instance
markers' counts, the order record, the bucket sizes of the instance markers in the keyed order or of the scatter
markers in the scatter order), or takes it from the task when the planner read it already (the local pool, which
reads the markers once instead of once per task). Over one bucket a new build is in the keyed order
(data_prep/keyed_order.py: the instance files grouped by bucket when made, no scatter); a folder begun in the
scatter order keeps it (bucket_stage.py).

A gather's marker records the shard's name, rows and sha256 (the manifest's entry, so `merge` reads no shard
again) and vouches for the shard's size (data_prep/task_markers.py). A shard found whole without its marker (a
task killed between the two) is hashed and given one; one cut short is cut again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.bucket_stage import (
    BucketedShardTask,
    ScatterTask,
    bucket_sizes,
    gather_bucketed,
    keyed_sizes,
    scatter,
    scatter_done,
)
from data_prep.build_errors import BuildError
from data_prep.config import NSP, BuildConfig
from data_prep.keyed_order import recorded_buckets
from data_prep.shard_format.atomic_io import sha256_file
from data_prep.shard_format.shards import SPLITS, ShardFormatError, read_table, write_shard_table
from data_prep.shard_stage import (
    BUCKET_INSTANCES,
    ShardTask,
    bucket_shuffle,
    count_instances,
    dropped_pieces,
    gather_rows,
    num_buckets,
    order_bucket,
    shard_ends,
    shard_plan,
)
from data_prep.task_markers import write_marker
from data_prep.work_layout import gather_stage, marker_path, shard_file

SHARD_ENTRY_KEYS = ("file", "num_instances", "sha256")  # a shard's entry in the manifest, as its marker holds it


@dataclass(frozen=True)
class StageSettings:
    """What every shard-stage task needs of the build's config."""

    out: Path
    num_shards: int  # input shards
    seq_lens: tuple[int, ...]
    seed: int
    outputs: tuple[tuple[str, int], ...]  # (split, output shards)

    @classmethod
    def of(cls, cfg: BuildConfig, num_shards: int) -> StageSettings:
        return cls(cfg.out_dir, num_shards, tuple(cfg.seq_lens), cfg.seed,
                   (("train", cfg.num_shards), ("val", cfg.num_val_shards)))


@dataclass(frozen=True)
class SplitOrder:
    """How one (length, split) is cut: its instances (and random-next ones), and the bucket size of its order."""

    count: int
    random_next: int
    bucket_instances: int
    keyed: int = 0  # the keyed order's bucket count (data_prep/keyed_order.py); 0: the scatter order's

    @property
    def buckets(self) -> int:
        return self.keyed or num_buckets(self.count, self.bucket_instances)

    @property
    def bucketed(self) -> bool:
        """Over one bucket: gathered bucket by bucket (from the scattered files, or the keyed instance files)."""
        return self.count > 0 and self.buckets > 1

    @property
    def scattered(self) -> bool:
        """Bucketed in the scatter order: a scatter per (input shard, length) first."""
        return self.bucketed and not self.keyed

    def sizes(self, settings: StageSettings, seq_len: int, split: str) -> np.ndarray:
        """Each bucket's rows in each input shard (input shards x buckets), from the markers that hold them."""
        read = keyed_sizes if self.keyed else bucket_sizes
        return read(settings.out, seq_len, split, settings.num_shards)


def split_order(settings: StageSettings, seq_len: int, split: str) -> SplitOrder:
    """From the instance markers (all of them done); records the bucket size before any shard is cut
    (shard_stage.order_bucket), so that every task, wherever it runs, cuts the same order."""
    count, random_next = count_instances(settings.out, seq_len, split, settings.num_shards)
    outputs = dict(settings.outputs)[split]
    if 0 < count < outputs:
        flag = "--num-shards" if split == "train" else "--num-val-shards"
        raise BuildError(f"{flag} {outputs}: only {count} {split} instances at sequence length {seq_len}; "
                         "lower it or add data")
    keyed = recorded_buckets(settings.out, seq_len, split)
    if keyed:  # recorded before the instance files, grouped by its buckets
        return SplitOrder(count, random_next, BUCKET_INSTANCES, keyed)
    bucket = order_bucket(settings.out, seq_len, split, count) if count else BUCKET_INSTANCES
    return SplitOrder(count, random_next, bucket)


def split_orders(settings: StageSettings) -> dict[tuple[int, str], SplitOrder]:
    return {(seq_len, split): split_order(settings, seq_len, split)
            for seq_len in settings.seq_lens for split in SPLITS}


@dataclass(frozen=True)
class ScatterJob:
    """The scatter of one (input shard, length); `buckets`: its (split, buckets over one) when the planner knows
    them (None: read from the folder; empty: nothing over one bucket, nothing to do)."""

    settings: StageSettings
    shard: int
    seq_len: int
    buckets: tuple[tuple[str, int], ...] | None = None


def scatter_jobs(settings: StageSettings, orders: dict[tuple[int, str], SplitOrder] | None = None) -> list[ScatterJob]:
    """Every (input shard, length), shard-major (job i: shard i // L, length i % L, as the instance tasks)."""
    def over(seq_len: int) -> tuple[tuple[str, int], ...] | None:
        if orders is None:
            return None
        return tuple((split, o.buckets) for split in SPLITS if (o := orders[(seq_len, split)]).scattered)
    return [ScatterJob(settings, shard, seq_len, over(seq_len))
            for shard in range(settings.num_shards) for seq_len in settings.seq_lens]


def scatter_needed(job: ScatterJob) -> bool:
    """Some split of its length is over one bucket and its marker is missing (`job.buckets` known)."""
    return bool(job.buckets) and not scatter_done(job.settings.out, job.seq_len, job.shard)


def run_scatter(job: ScatterJob) -> None:
    settings = job.settings
    buckets = job.buckets
    if buckets is None:
        orders = {split: split_order(settings, job.seq_len, split) for split in SPLITS}
        buckets = tuple((s, o.buckets) for s, o in orders.items() if o.scattered)
    if buckets and not scatter_done(settings.out, job.seq_len, job.shard):
        scatter(ScatterTask(settings.out, settings.num_shards, job.shard, job.seq_len, settings.seed, buckets))


@dataclass(frozen=True)
class GatherTask:
    """Output shard `index` of (seq_len, split); `order` and `sizes` (the scatter markers' bucket sizes) when the
    planner read them (None: read from the folder)."""

    settings: StageSettings
    seq_len: int
    split: str
    index: int
    order: SplitOrder | None = None
    sizes: np.ndarray | None = None
    rows: np.ndarray | None = None  # one bucket: the shard's rows, cut by the planner from the one permutation


def with_rows(tasks: Iterable[GatherTask]) -> Iterator[GatherTask]:
    """The tasks, those of a split within one bucket given their rows, cut lazily from the split's permutation
    (shard_stage.shard_plan: the planner holds it once, not every task): what a pool's planner hands out."""
    plans: dict[tuple[int, str], Iterator[np.ndarray]] = {}
    for task in tasks:
        order = task.order
        if order is None or order.bucketed or order.count == 0:
            yield task
            continue
        key = (task.seq_len, task.split)
        if key not in plans:
            plans = {key: enumerate(shard_plan(order.count, dict(task.settings.outputs)[task.split],
                                               task.settings.seed, task.seq_len, task.split,
                                               order.bucket_instances))}
        index, rows = next(plans[key])
        while index < task.index:  # a share skips the other nodes' shards
            index, rows = next(plans[key])
        yield replace(task, rows=rows)


def gather_tasks(settings: StageSettings, orders: dict[tuple[int, str], SplitOrder] | None = None) -> list[GatherTask]:
    """Every output shard: length-major, then train before val, then the shard (without `orders`: the list
    SLURM's gather elements index). With `orders` (a pool's planner), the splits without instances are left out
    and the bucketed ones carry their sizes."""
    tasks = []
    for seq_len in settings.seq_lens:
        for split, outputs in settings.outputs:
            order = orders[(seq_len, split)] if orders is not None else None
            if order is not None and order.count == 0:
                continue
            sizes = None
            if order is not None and order.bucketed:
                sizes = order.sizes(settings, seq_len, split)
            tasks += [GatherTask(settings, seq_len, split, k, order, sizes) for k in range(outputs)]
    return tasks


def gather_marker(task: GatherTask) -> Path:
    return marker_path(task.settings.out, gather_stage(task.seq_len, task.split), task.index)


def gather_done(task: GatherTask) -> bool:
    return gather_marker(task).is_file()


def run_gather(task: GatherTask) -> None:
    """Cut output shard `index` (unless its marker is there), then its marker."""
    settings = task.settings
    if gather_done(task):
        return
    order = task.order or split_order(settings, task.seq_len, task.split)
    if order.count == 0:
        return  # the split has no instances: no shards
    ends = [0, *shard_ends(order.count, dict(settings.outputs)[task.split])]
    start, end = ends[task.index], ends[task.index + 1]
    name = shard_file(task.seq_len, task.split, task.index)
    path = settings.out / name
    if _complete(path, end - start):  # renamed in place, its marker not written yet (a kill between the two)
        count, digest = end - start, sha256_file(path)
    elif order.bucketed:
        sizes = task.sizes if task.sizes is not None else order.sizes(settings, task.seq_len, task.split)
        count, digest = write_shard_table(path, gather_bucketed(BucketedShardTask(
            settings.out, task.seq_len, task.split, settings.seed, task.index, start, end, sizes,
            keyed=bool(order.keyed))))
    else:  # one bucket: the single permutation (shard_stage.bucket_orders with B = 1), cut at the shard's ends
        rows = task.rows
        if rows is None:
            rows = bucket_shuffle(settings.seed, task.seq_len, task.split, None).permutation(order.count)[start:end].copy()
        count, digest = write_shard_table(path, gather_rows(ShardTask(
            settings.out, task.seq_len, task.split, settings.num_shards, task.index, rows)))
    write_marker(settings.out, gather_marker(task), {"file": name, "num_instances": count, "sha256": digest},
                 [path], known={path: digest})


def _complete(path: Path, rows: int) -> bool:
    """The shard is there and whole: a readable Arrow file of its rows. An atomic rename leaves only whole files,
    but one cut short since (its marker then dropped by task_markers.drop_broken_markers) is cut again."""
    try:
        return read_table(path).num_rows == rows
    except ShardFormatError:  # missing, or not a whole Arrow file
        return False


def seq_entry(cfg: BuildConfig, settings: StageSettings, seq_len: int,
              orders: dict[tuple[int, str], SplitOrder]) -> dict[str, Any]:
    """The manifest's entry of one length, from the gathers' markers (every gather done)."""
    entry: dict[str, Any] = {}
    for split, outputs in settings.outputs:
        order = orders[(seq_len, split)]
        # Packed modes only: what the packing dropped (nsp manifests keep their keys, and their bytes).
        dropped = dropped_pieces(settings.out, seq_len, split, settings.num_shards) if cfg.segments != NSP else {}
        if order.count == 0:
            entry[split] = {"num_instances": 0, "nsp_random_fraction": None, "shards": [], **dropped}
            continue
        shards = []
        for k in range(outputs):
            marker = json.loads(gather_marker(GatherTask(settings, seq_len, split, k)).read_text(encoding="utf-8"))
            shards.append({key: marker[key] for key in SHARD_ENTRY_KEYS})
        entry[split] = {
            "num_instances": order.count,
            "nsp_random_fraction": round(order.random_next / order.count, 6) if cfg.segments == NSP else None,
            "shards": shards,
            **dropped,
        }
    return entry
