"""`build --slurm`: the build as SLURM job arrays, one element per task, the way datatrove drives SLURM.

    corpus     array over blocks of --workers input shards not yet cleaned and tokenized (task corpus)
    instances  array over the (input shard, length) tasks not yet made     (task instances), afterok: corpus
    scatter    array over the (input shard, length) scatters not yet made  (task scatter), afterok: instances;
               an element whose length is not over one shuffle bucket does nothing
    gather     array over the output shards not yet cut                    (task gather), afterok: scatter
    merge      one job: anything left and the manifest                     (python -m data_prep merge), afterok

Only what has no completion marker is submitted, so a relaunch after a failure submits exactly the failed
and missing tasks, and a relaunch after completion submits nothing. Every element is idempotent (a
requeued element whose task finished does nothing), and the jobs ask SLURM to requeue them on a node
failure. The scripts are written to OUT/work/slurm/ (their logs go there too); `--print-sbatch` prints
them and the sbatch commands instead of submitting.

An array's indices are kept below SLURM's default MaxArraySize (1001): a stage with more tasks is several
arrays, each adding its base to SLURM_ARRAY_TASK_ID. Each stage's CPUs, memory and time limit, and how many
elements of an array run at once (`%N`), come from SlurmSettings (data_prep/slurm_settings.py).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import data_prep
from data_prep.build import BuildError, check_inputs
from data_prep.config import BuildConfig, ConfigError
from data_prep.corpus_index import missing_corpus_shards
from data_prep.instance_stage import instance_task_done
from data_prep.shard_format.atomic_io import atomic_write_bytes
from data_prep.shard_format.shards import MANIFEST_NAME
from data_prep.shard_tasks import StageSettings, gather_done, gather_tasks, scatter_jobs, split_orders
from data_prep.slurm_settings import SlurmSettings
from data_prep.stage_runs import instance_tasks
from data_prep.task_markers import drop_broken_markers
from data_prep.work_layout import marker_path, scatter_stage, slurm_dir

MAX_ARRAY_INDEX = 1000


@dataclass(frozen=True)
class Job:
    name: str
    command: str  # may use $INDEX (the task index: the array element plus the job's base)
    stage: str  # whose SlurmSettings resources it asks for
    indices: tuple[int, ...] = ()  # array elements, relative to `base`; empty: not an array
    base: int = 0
    after: tuple[str, ...] = ()  # names of the jobs this one waits for (afterok)


def array_spec(indices: tuple[int, ...]) -> str:
    """SLURM's --array value: runs of consecutive indices as ranges (0-3,7,9-10)."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def arrays(name: str, todo: list[int], command: str, after: tuple[str, ...]) -> list[Job]:
    """One job per block of MAX_ARRAY_INDEX tasks."""
    blocks: dict[int, list[int]] = {}
    for index in todo:
        blocks.setdefault(index // MAX_ARRAY_INDEX * MAX_ARRAY_INDEX, []).append(index)
    return [Job(f"{name}-{base}" if len(blocks) > 1 else name, command, name,
                tuple(i - base for i in members), base, after) for base, members in sorted(blocks.items())]


def plan_jobs(cfg: BuildConfig, num_shards: int, slurm: SlurmSettings) -> list[Job]:
    """The jobs still needed, in submission order."""
    out = cfg.out_dir
    python = f"{shlex.quote(sys.executable)} -m data_prep"
    target = shlex.quote(str(out.resolve()))
    # A corpus element runs a block of input shards, one corpus task per CPU (data_prep/corpus_stage.py).
    per_element = slurm.cpus("corpus", cfg.workers)
    blocks = sorted({shard // per_element for shard in missing_corpus_shards(out, num_shards)})
    jobs = arrays("corpus", blocks, f"{python} task corpus --out {target} --index $((INDEX * {per_element})) "
                  f"--count {per_element} --workers {per_element}", ())
    tasks = instance_tasks(cfg, num_shards)
    todo = [i for i, t in enumerate(tasks) if not instance_task_done(out, t.seq_len, t.shard)]
    jobs += arrays("instances", todo, f"{python} task instances --out {target} --index $INDEX --workers 1",
                   tuple(job.name for job in jobs))
    # Which lengths are over one bucket is known once the instances are (a relaunch): until then every scatter
    # without a marker is an element (one that finds its length within one bucket does nothing).
    settings = StageSettings.of(cfg, num_shards)
    orders = split_orders(settings) if not todo and not blocks else None  # instances all made: known
    todo = [i for i, job in enumerate(scatter_jobs(settings, orders))
            if (job.buckets is None or job.buckets)
            and not marker_path(out, scatter_stage(job.seq_len), job.shard).is_file()]
    jobs += arrays("scatter", todo, f"{python} task scatter --out {target} --index $INDEX --workers 1",
                   tuple(job.name for job in jobs))
    todo = [i for i, task in enumerate(gather_tasks(settings)) if not gather_done(task)]
    jobs += arrays("gather", todo, f"{python} task gather --out {target} --index $INDEX --workers 1",
                   tuple(job.name for job in jobs))
    keep = " --keep-work" if cfg.keep_work else ""
    workers = slurm.cpus("merge", cfg.workers)
    jobs.append(Job("merge", f"{python} merge --out {target} --workers {workers}{keep}", "merge",
                    after=tuple(job.name for job in jobs)))
    return jobs


def script(job: Job, out: Path, sbatch_args: list[str], slurm: SlurmSettings, workers: int) -> str:
    logs = slurm_dir(out).resolve()
    cpus = slurm.cpus(job.stage, workers)
    lines = ["#!/bin/bash", f"#SBATCH --job-name=data-prep-{job.name}", f"#SBATCH --cpus-per-task={cpus}",
             "#SBATCH --requeue", "#SBATCH --open-mode=append", *slurm.limits(job.stage)]
    if job.after:  # a failed task fails the stages after it at once, instead of leaving them pending forever
        lines.append("#SBATCH --kill-on-invalid-dep=yes")
    if job.indices:
        lines += [f"#SBATCH --array={array_spec(job.indices)}{slurm.throttle_suffix()}",
                  f"#SBATCH --output={logs}/{job.name}-%A_%a.log"]
    else:
        lines.append(f"#SBATCH --output={logs}/{job.name}-%j.log")
    lines += [f"#SBATCH {arg}" for arg in sbatch_args]
    repo = Path(data_prep.__file__).resolve().parent.parent
    lines += ["set -euo pipefail", f"cd {shlex.quote(str(repo))}", f"export RAYON_NUM_THREADS={cpus}"]
    if job.indices:
        lines.append(f"INDEX=$((SLURM_ARRAY_TASK_ID + {job.base}))")
    lines.append(f"exec {job.command}")
    return "\n".join(lines) + "\n"


def submit_build(cfg: BuildConfig, sbatch_args: list[str], print_only: bool,
                 slurm: SlurmSettings | None = None) -> list[str]:
    """Check everything a build checks, write the plan, then submit (or print) the jobs still needed;
    returns their SLURM job ids (none when printing or when the folder is complete)."""
    if cfg.vocab is None:
        raise ConfigError("--slurm needs a fixed --vocab FILE (every array element must tokenize with the same "
                          "vocab); train one first with a single-node build")
    plan = check_inputs(cfg, remove_temp=False)  # elements of an earlier submission may be writing
    out = cfg.out_dir
    if (out / MANIFEST_NAME).is_file():
        print(f"{out}: already complete (same config); nothing to submit")
        return []
    slurm = slurm or SlurmSettings()
    drop_broken_markers(out)  # a marker whose output is gone or cut short: its task is submitted again
    jobs = plan_jobs(cfg, plan.num_shards, slurm)
    ids: dict[str, str] = {}
    for job in jobs:
        path = slurm_dir(out) / f"{job.name}.sbatch"
        atomic_write_bytes(path, script(job, out, sbatch_args, slurm, cfg.workers).encode())
        dependency = ":".join(ids.get(name, f"<{name}>") for name in job.after)
        argv = ["sbatch", "--parsable", *([f"--dependency=afterok:{dependency}"] if job.after else []), str(path)]
        if print_only:
            print(f"# {path}\n{script(job, out, sbatch_args, slurm, cfg.workers)}\n{shlex.join(argv)}\n")
            continue
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"sbatch {path}: {done.stderr.strip() or done.stdout.strip()}")
        ids[job.name] = done.stdout.strip().split(";")[0]
        elements = f"{len(job.indices)} element(s)" if job.indices else "one job"
        print(f"submitted {job.name}: job {ids[job.name]} ({elements})", flush=True)
    return list(ids.values())
