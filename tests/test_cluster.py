"""Real cluster launches on this one machine: a SLURM cluster and two ssh "nodes", toy scale on CPU.

test_launch.py checks the commands launch.sh prints; here they run, through real daemons brought up
by tests/cluster/local_cluster.py (munge + slurmctld + slurmd; sshd on 127.0.0.1 with throwaway
keys), and the tests skip with the reason where this machine cannot host them. docs/launching.md
shows the same commands for rehearsing a real cluster's launch.

* `sbatch launch/slurm_pretrain.sbatch RUN.json --cpu --gpus 2` (the site #SBATCH lines overridden
  on the command line): scancel (SIGTERM) leaves a checkpoint and no requeue; the same sbatch resumes
  from it; SIGUSR1, sent the way the batch file's `--signal` asks SLURM to send it before the time
  limit, checkpoints, the job requeues itself once and completes both phases; every rank is pinned
  to the CPUs the allocation granted.
* Codistillation as two separate SLURM jobs that meet only in one exchange folder.
* `./launch.sh pretrain --hostfile` on "127.0.0.1" and "localhost" (pdsh + ssh, one rank each):
  list/dict overrides and a run folder with spaces, quotes, $ and % reach both nodes intact; killing
  one node's rank ends the whole job (non-zero, no rank left behind); the rerun resumes from the
  checkpoint and finishes both phases with exports.

A few launches cover everything: module-scoped fixtures run them and record what happened; the tests
only read the records.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.local_cluster import (
    ClusterUnavailable,
    LocalSlurm,
    LoopbackSsh,
    free_port,
    process_environ,
    processes_mentioning,
)
from tests.launch_util import REPO_ROOT, child_env
from tests.scripts.pretrain_fixtures import build_shards, tiny_run_config

pytestmark = pytest.mark.cluster

SBATCH_FILE = REPO_ROOT / "launch" / "slurm_pretrain.sbatch"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}
PHASE1_STEPS, PHASE2_STEPS = 40, 4  # phase 1 long enough that a signal lands inside it
# A folder name the remote shell and pdsh would mangle if unquoted: space, quotes, $, %n (pdsh: node
# rank), a brace list (bash brace expansion).
AWKWARD_NAME = "run dir/it's \"quoted\" $HOME 5%n {a,b}"
QUOTED_OVERRIDES = [
    '--run.phases=["phase1","phase2"]',
    '--phase1.ds_overrides={"gradient_accumulation_steps": 1}',
    '--model.overrides={"hidden_dropout_prob": 0.0}',
]


# ---------------------------------------------------------------------------------------------- helpers
def wait_for(check: Callable[[], bool], timeout: float, what: str, context: Callable[[], str] = lambda: "") -> None:
    """Poll `check`; fail with `what` and whatever `context` shows (a job's output) after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{context()}")
        time.sleep(0.2)


def tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(encoding="utf-8", errors="replace")[-chars:] if path.exists() else f"({path} absent)"


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's per-step records in the order written (the file is appended across restarts)."""
    path = run_dir / "tensorboard" / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [record for record in records if "phase" in record]


def latest_checkpoint(run_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """The `latest` tag and its trainer_state.json, or None before the first checkpoint."""
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    tag = pointer.read_text(encoding="utf-8").strip()
    return tag, json.loads((run_dir / "checkpoints" / tag / "trainer_state.json").read_text(encoding="utf-8"))


def run_config(path: Path, shards: Path, run_dir: Path, **sections: dict[str, Any]) -> Path:
    """The tiny two-phase RUN.json, with rare checkpoints/validation (fast) and `sections` merged in."""
    tiny_run_config(path, shards, run_dir, phase1=PHASE1_STEPS, phase2=PHASE2_STEPS)
    config = json.loads(path.read_text(encoding="utf-8"))
    config["checkpoint"].update(every_steps=10)
    config["logging"].update(val_every_steps=20)
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


@dataclass
class RankProbe:
    """What one running rank process was given, read from /proc while it trained."""

    rank: int
    cpus: frozenset[int]
    cpus_per_task: int | None


def rank_processes(marker: str) -> dict[int, int]:
    """{pid: RANK} of the pretrain.train processes whose command line contains `marker` (the run's config)."""
    ranks = {}
    for pid in processes_mentioning(marker):
        try:
            env = process_environ(pid)
            is_rank = b"pretrain.train" in Path(f"/proc/{pid}/cmdline").read_bytes() and "RANK" in env
        except OSError:
            continue
        if is_rank:
            ranks[pid] = int(env["RANK"])
    return ranks


def probe_ranks(marker: str) -> list[RankProbe]:
    probes = []
    for pid, rank in rank_processes(marker).items():
        try:
            per_task = process_environ(pid).get("SLURM_CPUS_PER_TASK")
            probes.append(RankProbe(rank, frozenset(os.sched_getaffinity(pid)), int(per_task) if per_task else None))
        except OSError:
            continue
    return sorted(probes, key=lambda probe: probe.rank)


def kill_leftovers(marker: str) -> None:
    """SIGKILL, by pid, any process still naming this test's folder (ranks reached over ssh included)."""
    for pid in processes_mentioning(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------------------------- daemons
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("cluster")
    build_shards(root / "shards")
    yield root
    kill_leftovers(str(root))


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    try:
        cluster = LocalSlurm().start()
    except ClusterUnavailable as err:
        pytest.skip(f"no local SLURM: {err}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def ssh_nodes() -> Iterator[LoopbackSsh]:
    try:
        nodes = LoopbackSsh().start()
    except ClusterUnavailable as err:
        pytest.skip(f"no loopback ssh nodes: {err}")
    yield nodes
    nodes.stop()


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

    def __init__(self, slurm: LocalSlurm, logs: Path) -> None:
        self.slurm, self.logs = slurm, logs
        # no SLURM_* of an allocation pytest itself might run in; the job finds python through $PYTHON
        env = {key: value for key, value in child_env().items() if not key.startswith("SLURM_")}
        self.env = {**env, **slurm.env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}

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
    jobs = SlurmJobs(slurm, workdir)
    run_dir = workdir / "slurm_run"
    config = run_config(workdir / "slurm_run.json", workdir / "shards", run_dir)
    cpus_per_task = 2 if slurm.cpus >= 4 else 1  # 2 when the machine has room: srun must pass it on to the tasks
    command = [str(config), "--cpu", "--gpus", "2"]
    shape = slurm_shape(2, cpus_per_task)

    first = jobs.submit(shape, command)
    wait_for(lambda: len(step_records(run_dir)) >= 2, 480, "job 1 to train two steps",
             lambda: tail(jobs.output_file(first)))
    ranks = probe_ranks(str(config))
    jobs.scancel(first)  # SIGTERM to every process of the job, SIGKILL after KillWait (30 s)
    cancelled = jobs.wait_final(first, 300)
    checkpoint = latest_checkpoint(run_dir)
    records_after_cancel = len(step_records(run_dir))

    usr1_options, usr1_target = usr1_as_the_time_limit_sends_it()
    second = jobs.submit(shape, command)
    wait_for(lambda: len(step_records(run_dir)) >= records_after_cancel + 2, 480, "job 2 to train two steps",
             lambda: tail(jobs.output_file(second)))
    jobs.scancel(second, *usr1_options)
    requeued = jobs.wait_final(second, 600)
    return PreemptionRecord(run_dir, ranks, cpus_per_task, cancelled, checkpoint, requeued, usr1_target,
                            records_after_cancel, step_records(run_dir))


def test_slurm_ranks_are_pinned_to_the_cpus_the_allocation_granted(preemption: PreemptionRecord) -> None:
    ranks, per_task = preemption.ranks, preemption.cpus_per_task
    assert [probe.rank for probe in ranks] == [0, 1], ranks
    for probe in ranks:
        assert probe.cpus_per_task == per_task, f"rank {probe.rank}: SLURM_CPUS_PER_TASK={probe.cpus_per_task}"
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
        f"not requeued after the SIGUSR1 stop (launch/slurm_pretrain.sbatch should run scontrol requeue): "
        f"{job.final}\n{job.output[-4000:]}"
    )
    assert job.output.count("done: complete") == 2, job.output[-4000:]  # both ranks of the requeued run
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


# ---------------------------------------------------------------------------------------------- hostfile
@dataclass
class HostfileRecord:
    """The killed launch (status, how fast it ended, what it left) and the rerun (status, log, metrics)."""

    run_dir: Path
    killed_status: int
    seconds_to_end_after_kill: float
    leftovers: list[int]
    checkpoint_after_kill: tuple[str, dict[str, Any]] | None
    records_after_kill: int
    rerun_status: int
    rerun_log: str
    records: list[dict[str, Any]]


def launch_hostfile(ssh: LoopbackSsh, workdir: Path, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**child_env(), **ssh.env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    hosts = ssh.hostfile(workdir / "hosts")
    command = ["bash", str(REPO_ROOT / "launch.sh"), "pretrain", "--hostfile", str(hosts), "--cpu", "--gpus", "1",
               "--master-port", str(free_port()), *args]
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(proc: subprocess.Popen[bytes], timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"launch.sh still running after {timeout} s\n{tail(log)}") from None


@pytest.fixture(scope="module")
def hostfile_runs(ssh_nodes: LoopbackSsh, workdir: Path) -> HostfileRecord:
    """One launch with awkward overrides, whose second node's rank is killed once it checkpointed; then the
    same command again, which must resume and finish."""
    run_dir = workdir / "hostfile" / AWKWARD_NAME
    # every value below differs from the file's, so the run shows whether each override arrived
    config = run_config(workdir / "hostfile.json", workdir / "shards", workdir / "overridden",
                        run={"phases": ["phase1"]})
    args = ["--config", str(config), f"--run.dir={run_dir}", *QUOTED_OVERRIDES]
    killed_log, rerun_log = workdir / "hostfile-killed.log", workdir / "hostfile-rerun.log"

    proc = launch_hostfile(ssh_nodes, workdir, args, killed_log)
    try:
        wait_for(lambda: latest_checkpoint(run_dir) is not None or proc.poll() is not None, 480,
                 "the first checkpoint", lambda: tail(killed_log))
        victims = [pid for pid, rank in rank_processes(str(config)).items() if rank == 1]
        assert proc.poll() is None and victims, f"the run ended before the kill:\n{tail(killed_log)}"
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)  # node "localhost" loses its rank
        status = finish(proc, 360, killed_log)
        seconds = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(1)  # sshd's session processes on the other "node" exit right after
    leftovers = sorted(rank_processes(str(config)))
    checkpoint, records_after_kill = latest_checkpoint(run_dir), len(step_records(run_dir))

    rerun = launch_hostfile(ssh_nodes, workdir, args, rerun_log)
    rerun_status = finish(rerun, 600, rerun_log)
    return HostfileRecord(run_dir, status, seconds, leftovers, checkpoint, records_after_kill, rerun_status,
                          tail(rerun_log, 400_000), step_records(run_dir))


def test_hostfile_overrides_reach_every_node_intact(hostfile_runs: HostfileRecord) -> None:
    assert hostfile_runs.rerun_status == 0, hostfile_runs.rerun_log[-6000:]
    resolved = json.loads((hostfile_runs.run_dir / "config.resolved.json").read_text(encoding="utf-8"))
    assert resolved["run"]["dir"] == str(hostfile_runs.run_dir)
    assert resolved["run"]["phases"] == ["phase1", "phase2"]
    assert resolved["phase1"]["ds_overrides"] == {"gradient_accumulation_steps": 1}
    assert resolved["resolved"]["ds_configs"]["phase1"]["gradient_accumulation_steps"] == 1
    assert resolved["resolved"]["ds_configs"]["phase2"]["gradient_accumulation_steps"] == 2  # the file's value
    assert resolved["model"]["overrides"] == {"hidden_dropout_prob": 0.0}
    assert resolved["resolved"]["model_config"]["hidden_dropout_prob"] == 0.0
    # config.resolved.json is rank 0's view; the launcher's log shows what each node's rank got.
    spawned = re.findall(r"^(\S+): .*spawned with command: (\[.*\])$", hostfile_runs.rerun_log, re.MULTILINE)
    argv_by_node = {node: ast.literal_eval(argv)[-4:] for node, argv in spawned}  # DeepSpeed logs a list
    expected = [f"--run.dir={hostfile_runs.run_dir}", *QUOTED_OVERRIDES]
    assert argv_by_node == {"127.0.0.1": expected, "localhost": expected}, spawned


def test_hostfile_launch_leaves_no_env_file_behind(hostfile_runs: HostfileRecord) -> None:
    """launch.sh writes its rank variables to a DS_ENV_FILE for the runner; one per launch must not pile up."""
    env_files = re.findall(r"^\+ export DS_ENV_FILE=(\S+)$", hostfile_runs.rerun_log, re.MULTILINE)
    assert len(env_files) == 1, env_files
    assert not Path(env_files[0]).exists(), env_files


def test_hostfile_killed_node_ends_the_job_and_the_rerun_resumes(hostfile_runs: HostfileRecord) -> None:
    record = hostfile_runs
    assert record.killed_status != 0
    assert record.seconds_to_end_after_kill < 120, record.seconds_to_end_after_kill
    assert record.leftovers == [], f"ranks left running after the job ended: {record.leftovers}"
    assert record.checkpoint_after_kill is not None
    tag, state = record.checkpoint_after_kill
    assert state["phase"] == "phase1" and not state["complete"], state
    # The rerun starts right after the checkpoint (steps trained after it are trained again), and runs on.
    rerun = record.records[record.records_after_kill:]
    assert rerun and rerun[0]["phase"] == "phase1" and rerun[0]["phase_step"] == state["step"] + 1, (tag, rerun[:2])
    assert [r["step"] for r in rerun] == list(range(state["step"] + 1, PHASE1_STEPS + PHASE2_STEPS + 1))
    assert record.rerun_log.count("done: complete") == 2, record.rerun_log[-4000:]
    for phase in ("phase1", "phase2"):
        assert (record.run_dir / "export" / phase / "export_info.json").is_file()
