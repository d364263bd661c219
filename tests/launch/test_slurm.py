"""Real cluster launches on this one machine: a SLURM cluster, toy scale on CPU.

test_launch_sh.py checks the commands launch.sh prints; here they run, through real daemons brought up
by tests/support/cluster/local_cluster.py (munge + slurmctld + slurmd; sshd on 127.0.0.1 with throwaway
keys), and the tests skip with the reason where this machine cannot host them. docs/launching.md
shows the same commands for rehearsing a real cluster's launch.

* `sbatch slurm/slurm_pretrain.sbatch RUN.json --cpu --gpus 2` (the site #SBATCH lines overridden
  on the command line): scancel (SIGTERM) leaves a checkpoint and no requeue; the same sbatch resumes
  from it; SIGUSR1, sent the way the batch file's `--signal` asks SLURM to send it before the time
  limit, checkpoints, the job requeues itself once and completes both phases; every rank is pinned
  to the CPUs the allocation granted.
* Codistillation as two separate SLURM jobs that meet only in one exchange folder.
* The hostfile launches (pdsh + ssh "nodes") are in test_hostfile.py.

A few launches cover everything: module-scoped fixtures run them and record what happened; the tests
only read the records.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster.local_cluster import LocalSlurm, running_or_skip
from tests.support.cluster.runs import (
    PHASE2_STEPS,
    RankProbe,
    kill_leftovers,
    latest_checkpoint,
    probe_ranks,
    run_config,
    step_records,
    tail,
    wait_for,
)
from tests.support.launching import REPO_ROOT, Hold, child_env
from tests.support.pretrain_fixtures import build_shards

pytestmark = pytest.mark.cluster

SBATCH_FILE = REPO_ROOT / "slurm" / "slurm_pretrain.sbatch"
# The two stops land at steps 3 and 6 (the ranks are held there) and the requeued job trains the rest: 12 steps hold
# them (the shared toy config has 40, a length from before the holds).
PHASE1_STEPS = 12
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


# ---------------------------------------------------------------------------------------------- daemons
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("cluster")
    build_shards(root / "shards")
    yield root
    kill_leftovers(str(root))


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    yield from running_or_skip(LocalSlurm(), "local SLURM")



# ---------------------------------------------------------------------------------------------- SLURM
def usr1_as_the_time_limit_sends_it() -> tuple[list[str], str]:
    """scancel options that deliver SIGUSR1 where the batch file's `#SBATCH --signal=[B:]USR1@T` has SLURM
    deliver it before the time limit: "B:" = the batch shell only, else every job step (the ranks)."""
    match = re.search(r"^#SBATCH\s+--signal=(B:)?USR1@\d+", SBATCH_FILE.read_text(encoding="utf-8"), re.MULTILINE)
    assert match, f"{SBATCH_FILE} has no '#SBATCH --signal=[B:]USR1@SECONDS' line"
    if match.group(1):
        return ["--signal=USR1", "--batch"], "the batch shell (#SBATCH --signal=B:USR1@...)"
    return ["--signal=USR1"], "every job step, i.e. the ranks (#SBATCH --signal=USR1@...)"


@dataclass
class SlurmJobRecord:
    """A job once it ended: SLURM's own view of it (state, restarts, exit code, times) and its output."""

    job_id: int
    final: dict[str, str]  # scontrol show job, once it ended
    output: str


@dataclass
class PreemptionRecord:
    """What the cancel / resume / SIGUSR1 / requeue sequence left behind, for the tests to check."""

    run_dir: Path
    ranks: list[RankProbe]
    cpus_per_task: int
    cancelled: SlurmJobRecord
    checkpoint_after_cancel: tuple[str, dict[str, Any]] | None
    requeued: SlurmJobRecord
    usr1_target: str
    records_after_cancel: int  # metrics.jsonl step records written before the second job started
    records: list[dict[str, Any]]


class SlurmJobs:
    """sbatch / wait / signal against the local cluster, with the test's environment."""

    def __init__(self, slurm: LocalSlurm, logs: Path, hold: Hold | None = None) -> None:
        self.slurm, self.logs = slurm, logs
        # no SLURM_* of an allocation pytest itself might run in; the job finds python through $PYTHON
        env = {key: value for key, value in child_env().items() if not key.startswith("SLURM_")}
        self.env = {**env, **slurm.env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(hold.env if hold else {})}

    def output_file(self, job_id: int) -> Path:
        return self.logs / f"job-{job_id}.out"

    def submit(self, sbatch_options: list[str], args: list[str]) -> int:
        """sbatch the repository's batch file from the checkout, as README says, site lines overridden."""
        command = ["sbatch", "--parsable", f"--output={self.logs}/job-%j.out", "--open-mode=append",
                   *sbatch_options, str(SBATCH_FILE), *args]
        proc = subprocess.run(command, cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{command} failed: {proc.stderr}"
        return int(proc.stdout.strip().split(";")[0])

    def state(self, job_id: int) -> dict[str, str]:
        return self.slurm.job(job_id)

    def wait_final(self, job_id: int, timeout: float) -> SlurmJobRecord:
        holder: dict[str, dict[str, str]] = {}

        def ended() -> bool:
            holder["job"] = self.state(job_id)
            return holder["job"].get("JobState") in FINAL_STATES

        wait_for(ended, timeout, f"SLURM job {job_id} to end", lambda: f"{holder}\n{tail(self.output_file(job_id))}")
        return SlurmJobRecord(job_id, holder["job"], tail(self.output_file(job_id), 200_000))

    def scancel(self, job_id: int, *options: str) -> None:
        self.slurm.command("scancel", *options, str(job_id))


def slurm_shape(ntasks: int, cpus_per_task: int) -> list[str]:
    """The site #SBATCH lines, overridden: one node, CPU ranks, no GPUs, a time limit far beyond the run
    (the batch file's --signal=...@600 would otherwise fire at once under a short limit)."""
    return ["--nodes=1", f"--ntasks-per-node={ntasks}", "--gpus-per-node=0", f"--cpus-per-task={cpus_per_task}",
            "--time=60", "--job-name=bert-cluster-test"]


@pytest.fixture(scope="module")
def preemption(slurm: LocalSlurm, workdir: Path) -> PreemptionRecord:
    """Job 1: scancel (SIGTERM) while training. Job 2 (the same sbatch): resumes, then SIGUSR1 as before the
    time limit -> checkpoint, `scontrol requeue` by the batch file, resumed again, complete."""
    hold = Hold(workdir / "hold-preemption").at(3)  # each signal comes while the ranks wait before a known step
    jobs = SlurmJobs(slurm, workdir, hold)
    run_dir = workdir / "slurm_run"
    config = run_config(workdir / "slurm_run.json", workdir / "shards", run_dir, phase1={"steps": PHASE1_STEPS})
    cpus_per_task = 2 if slurm.cpus >= 4 else 1  # 2 when the machine has room: srun must pass it on to the tasks
    command = [str(config), "--cpu", "--gpus", "2"]
    shape = slurm_shape(2, cpus_per_task)

    first = jobs.submit(shape, command)
    wait_for(lambda: len(step_records(run_dir)) >= 2, 480, "job 1 to train two steps",
             lambda: tail(jobs.output_file(first)))
    ranks = probe_ranks(str(config))
    jobs.scancel(first)  # SIGTERM to every process of the job, SIGKILL after KillWait (30 s)
    hold.release()
    cancelled = jobs.wait_final(first, 300)
    checkpoint = latest_checkpoint(run_dir)
    records_after_cancel = len(step_records(run_dir))

    usr1_options, usr1_target = usr1_as_the_time_limit_sends_it()
    hold.at(records_after_cancel + 3)
    second = jobs.submit(shape, command)
    wait_for(lambda: len(step_records(run_dir)) >= records_after_cancel + 2, 480, "job 2 to train two steps",
             lambda: tail(jobs.output_file(second)))
    jobs.scancel(second, *usr1_options)
    hold.release()
    requeued = jobs.wait_final(second, 600)
    return PreemptionRecord(run_dir, ranks, cpus_per_task, cancelled, checkpoint, requeued, usr1_target,
                            records_after_cancel, step_records(run_dir))


def test_slurm_ranks_are_pinned_to_the_cpus_the_allocation_granted(preemption: PreemptionRecord) -> None:
    ranks, per_task = preemption.ranks, preemption.cpus_per_task
    assert [probe.rank for probe in ranks] == [0, 1], ranks
    # The node's one task (our agent) holds both ranks' CPUs; each rank runs on its own share
    # (pretrain/launch/pin.py), as SLURM's own binding did when every rank was a task.
    for probe in ranks:
        assert probe.threads == per_task, f"rank {probe.rank}: OMP_NUM_THREADS={probe.threads}"
        assert len(probe.cpus) == per_task, f"rank {probe.rank} may run on CPUs {sorted(probe.cpus)}"
    assert not ranks[0].cpus & ranks[1].cpus, f"ranks share CPUs: {ranks}"


def test_slurm_scancel_checkpoints_without_requeue(preemption: PreemptionRecord) -> None:
    job = preemption.cancelled
    assert job.final["JobState"] == "CANCELLED" and job.final["Restarts"] == "0", job.final
    assert re.search(r"stopped \(SIGTERM\) at phase1 step \d+; checkpoint phase1-step\d+ written", job.output), (
        job.output[-4000:]
    )
    assert "requeueing" not in job.output
    assert preemption.checkpoint_after_cancel is not None, "scancel left no checkpoint"
    tag, state = preemption.checkpoint_after_cancel
    # the stop checkpoint is the last step trained: nothing is lost, and it is resumable (next test)
    assert state["phase"] == "phase1" and 0 < state["step"] < PHASE1_STEPS and not state["complete"], state
    assert state["step"] == preemption.records[preemption.records_after_cancel - 1]["phase_step"]
    assert tag == f"phase1-step{state['step']:07d}"


def test_slurm_usr1_checkpoints_requeues_and_the_job_completes(preemption: PreemptionRecord) -> None:
    job = preemption.requeued
    assert job.final["JobState"] == "COMPLETED" and job.final["ExitCode"] == "0:0", job.final
    stops = re.findall(r"stopped \(SIGUSR1\) at phase1 step (\d+)", job.output)
    assert len(stops) == 1, f"SIGUSR1 to {preemption.usr1_target}: expected one stop\n{job.output[-4000:]}"
    # The batch file requeues itself after the SIGUSR1 stop, exactly once: the resumed run completes.
    assert job.final["Restarts"] == "1", (
        f"not requeued after the SIGUSR1 stop (slurm/slurm_pretrain.sbatch should run scontrol requeue): "
        f"{job.final}\n{job.output[-4000:]}"
    )
    assert job.output.count("done: complete") == 2, job.output[-4000:]  # both ranks of the requeued run
    # the requeued run names the previous run's end, from the note the batch file left when it requeued itself
    assert re.search(r"runs again \(requeue 1: this script requeued it after a time-limit stop \(SIGUSR1\) on \S+ at "
                     r"\S+\); resuming from the newest checkpoint", job.output), job.output[:3000]
    # Every optimizer step of the three runs appears once, in order: each run resumed where the last stopped.
    steps = [record["step"] for record in preemption.records]
    assert steps == list(range(1, PHASE1_STEPS + PHASE2_STEPS + 1)), steps
    tag, state = latest_checkpoint(preemption.run_dir) or ("", {})
    assert state.get("phase") == "phase2" and state.get("complete"), (tag, state)
    for phase in ("phase1", "phase2"):
        assert (preemption.run_dir / "export" / phase / "export_info.json").is_file()


@dataclass
class CodistillRecord:
    """The two groups' jobs (group 0 first) and the folders they shared."""

    jobs: list[SlurmJobRecord]
    run_dir: Path
    exchange: Path


@pytest.fixture(scope="module")
def codistill_jobs(slurm: LocalSlurm, workdir: Path) -> CodistillRecord:
    """README's two-separate-jobs codistillation: one sbatch per group, meeting only in `exchange` (a folder
    name with a space: it travels through sbatch, launch.sh and srun). One rank of one CPU per job, both
    running at once."""
    jobs = SlurmJobs(slurm, workdir)
    run_dir, exchange = workdir / "codistill_run", workdir / "codistill exchange"
    codistill = {"enabled": True, "groups": 2, "alpha": 1.0, "burn_in_steps": 2, "refresh_every": 2,
                 "targets": ["mlm"], "exchange_timeout_s": 180.0}
    config = run_config(workdir / "codistill.json", workdir / "shards", run_dir, codistill=codistill)
    ids = [jobs.submit(slurm_shape(1, 1), [str(config), "--cpu", "--gpus", "1", '--run.phases=["phase1"]',
                                           "--phase1.steps=6", f"--codistill.group={group}",
                                           "--codistill.exchange=filesystem", f"--codistill.exchange_dir={exchange}"])
           for group in (0, 1)]
    return CodistillRecord([jobs.wait_final(job_id, 600) for job_id in ids], run_dir, exchange)


def test_codistillation_as_two_slurm_jobs_meeting_in_one_folder(codistill_jobs: CodistillRecord) -> None:
    for group, job in enumerate(codistill_jobs.jobs):
        assert job.final["JobState"] == "COMPLETED", f"group {group}: {job.final}\n{job.output[-4000:]}"
        other = str(1 - group)
        final = json.loads((codistill_jobs.run_dir / f"group{group}" / "codistill_final.json").read_text())
        # the last refresh waited for the other job's final weights: the jobs really met in the folder
        assert final["group"] == group and final["teacher_steps"] == {other: 6}, final
        distilled = [r for r in step_records(codistill_jobs.run_dir / f"group{group}") if r.get("codistill/active")]
        assert distilled and all(r["codistill/distill_loss"] > 0 for r in distilled), distilled
        assert any((codistill_jobs.exchange / f"group{group}").iterdir()), "nothing published"
    starts = [job.final["StartTime"] for job in codistill_jobs.jobs]
    ends = [job.final["EndTime"] for job in codistill_jobs.jobs]
    assert max(starts) < min(ends), f"the jobs did not overlap: {starts} {ends}"
