"""`python -m data_prep task STAGE --index I`: one task of a started build, what a SLURM array element runs
(data_prep/slurm_arrays.py numbers them). Each stage's tasks are a fixed list that the folder alone decides:

    corpus     input shards I .. I + count - 1 (clean + tokenize), --workers at a time
    instances  instance task I: input shard I // L at the (I mod L)-th length   (stage_runs.instance_tasks)
    scatter    the scatter of input shard I // L at the (I mod L)-th length; nothing unless a split of that
               length is over one bucket in the scatter order (data_prep/keyed_order.py: a folder begun
               before the keyed order)                                          (shard_tasks.scatter_jobs)
    gather     output shard I of the list length-major, train then val          (shard_tasks.gather_tasks)

A task whose marker exists does nothing (a requeued element), and one whose inputs are not all there says which
stage to run first.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from data_prep.build import prepare_corpus, recorded_config
from data_prep.build_errors import BuildError, FolderComplete
from data_prep.corpus_index import missing_corpus_shards
from data_prep.input_plan import load_plan
from data_prep.instance_stage import instance_task_done, make_instances
from data_prep.parallel import Workers
from data_prep.shard_tasks import (
    StageSettings,
    gather_marker,
    gather_tasks,
    run_gather,
    run_scatter,
    scatter_jobs,
    split_orders,
)
from data_prep.stage_runs import instance_markers, instance_tasks, scatter_markers
from data_prep.task_markers import drop_broken_markers
from data_prep.work_layout import CLEAN_STAGE, TOKENS_STAGE, instances_stage, marker_path, scatter_stage

TASK_STAGES = ("corpus", "instances", "scatter", "gather")


def run_task(out: Path, stage: str, index: int, workers: int, count: int = 1) -> None:
    """One task (or, for `corpus`, a block of `count`); a finished folder: nothing to do."""
    try:
        cfg = recorded_config(out, "task", workers=workers)
    except FolderComplete as done:
        print(done)
        return
    plan = load_plan(out)
    if stage == "corpus":
        if not 0 <= index < plan.num_shards or count < 1:
            raise BuildError(f"task corpus --index {index} --count {count}: the plan has {plan.num_shards} input "
                             "shard(s)")
        shards = list(range(index, min(index + count, plan.num_shards)))
        drop_broken_markers(out, [marker_path(out, stage, s) for s in shards for stage in (CLEAN_STAGE, TOKENS_STAGE)])
        with Workers(workers) as pool:
            prepare_corpus(cfg, plan, shards, pool)
        return
    missing = missing_corpus_shards(out, plan.num_shards)
    if missing:
        raise BuildError(f"task {stage} --out {out}: input shard(s) {missing[:8]} not cleaned and tokenized yet "
                         "(run their `task corpus` first)")
    if stage == "instances":
        tasks = instance_tasks(cfg, plan.num_shards)
        task = tasks[_checked(stage, index, len(tasks))]
        drop_broken_markers(out, [marker_path(out, instances_stage(task.seq_len), task.shard)])
        if not instance_task_done(out, task.seq_len, task.shard):
            make_instances(task)
        return
    not_made = [m for m in instance_markers(cfg, plan.num_shards) if not m.is_file()]
    if not_made:
        raise BuildError(f"task {stage} --out {out}: instance task(s) not done yet ({not_made[0].name} ...; run "
                         "every `task instances` first)")
    settings = StageSettings.of(cfg, plan.num_shards)
    if stage == "scatter":
        jobs = scatter_jobs(settings)
        job = jobs[_checked(stage, index, len(jobs))]
        drop_broken_markers(out, [marker_path(out, scatter_stage(job.seq_len), job.shard)])
        run_scatter(job)
        return
    tasks = gather_tasks(settings)
    task = tasks[_checked(stage, index, len(tasks))]
    orders = split_orders(settings)  # a bucketed split is cut from the scattered files: all of them there
    not_scattered = [m for m in scatter_markers(settings, orders) if not m.is_file()]
    if not_scattered and orders[(task.seq_len, task.split)].scattered:
        raise BuildError(f"task gather --out {out}: scatter task(s) not done yet ({not_scattered[0].name} ...; "
                         "run every `task scatter` first)")
    drop_broken_markers(out, [gather_marker(task)])
    run_gather(replace(task, order=orders[(task.seq_len, task.split)]))  # the markers read once, above


def _checked(stage: str, index: int, count: int) -> int:
    if not 0 <= index < count:
        raise BuildError(f"task {stage} --index {index}: there are {count} {stage} task(s)")
    return index
