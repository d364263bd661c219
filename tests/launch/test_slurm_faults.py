"""Runs that heal themselves under SLURM, for real: a two-node SLURM cluster on this machine (two slurmd daemons,
tests/support/cluster/local_cluster.py), one CPU rank per node, submitted with the repository's batch file.

Inside the allocation each node's elastic agent is one task of one srun step (pretrain/launch/nodes.py,
transports.py). One job, with `--nodes 1:2` (and sbatch's `--no-kill`, as docs/faults.md says):

1. kill -9 of rank 1 after the first checkpoint: both nodes' ranks restart inside the allocation, no requeue;
2. then, past the next checkpoint, node 2's agent killed alone: its rank dies with it (a node fault, never a stop),
   the job carries on with one node and resumes on one rank;

and the job completes, its export equal to an uninterrupted 2-rank run's to float rounding (the world size
changed: dropout off). Each fault is one line, no traceback. A second job without `--nodes MIN:MAX` loses its
node 2 (agent and rank): one error line naming it, the job fails, nothing of it left running. A third, with
`--nodes 1:2`, has node 2's rank die the same way at each start: the node is dropped after two (its agent ended
through an overlapping srun step), node 1 finishes the run (4 steps), and once the job is requeued
(`scontrol requeue` of the finished job) its batch script starts no agent on node 2.

Each act waits for the run to hold before a known step (tests/support/launching.py Hold), whatever the machine's
speed: an idle machine once finished the run before the second act.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch.conftest import ElasticReference
from tests.launch.test_slurm import FINAL_STATES, SlurmJobRecord, SlurmJobs
from tests.support.cluster.local_cluster import LocalSlurm, running_or_skip
from tests.support.cluster.processes import parent, processes_mentioning
from tests.support.cluster.runs import (
    kill_leftovers,
    latest_checkpoint,
    rank_processes,
    step_records,
    tail,
    wait_for,
)
from tests.support.launching import Hold

pytestmark = pytest.mark.cluster

SHAPE = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=60",
         "--job-name=bert-slurm-faults"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("slurm_faults")
    yield root
    kill_leftovers(str(root))


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    yield from running_or_skip(LocalSlurm(nodes=2), "local two-node SLURM")


def node_processes(marker: str, node: str, ranks: bool = True) -> list[int]:
    """The agent of SLURM node `node` (an srun task: SLURMD_NODENAME in its environment), and its ranks."""
    agents = []
    for pid in processes_mentioning(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pretrain.launch.agent" in argv and b"python" in argv[0] and f"SLURMD_NODENAME={node}".encode() in environ:
            agents.append(pid)
    return agents + ([pid for pid in rank_processes(marker) if parent(pid) in agents] if ranks else [])


def held_at(run_dir: Path, step: int, checkpoint: int | None = None) -> bool:
    """The run logged `step` (the hold stops it before the next) and its checkpoint of step `checkpoint` is whole."""
    records = step_records(run_dir)
    done = latest_checkpoint(run_dir)
    whole = checkpoint is None or (done is not None and done[1]["step"] >= checkpoint)
    return bool(records) and records[-1]["step"] >= step and whole


def faults(output: str) -> list[str]:
    return re.findall(r"^launch\.sh: (?:fault|error): .*$", output, re.MULTILINE)


@dataclass
class SlurmFaultRecord:
    healed: SlurmJobRecord
    healed_dir: Path
    reference: ElasticReference
    strict: SlurmJobRecord
    strict_leftovers: list[int]
    node: str
    dropped: SlurmJobRecord
    dropped_dir: Path
    dropped_kills: int


@pytest.fixture(scope="module")
def slurm_faults(slurm: LocalSlurm, workdir: Path, elastic_reference: ElasticReference) -> SlurmFaultRecord:
    hold = Hold(workdir / "hold").at(13)
    jobs = SlurmJobs(slurm, workdir, hold)
    config = elastic_reference.config  # the steps are the same on 1 or 2 ranks (tests/launch/conftest.py)
    # The nodes' names resolve nowhere: the agents meet on 127.0.0.1 (on a cluster, the first node's name).
    common = [str(config), "--cpu", "--gpus", "1", "--master-addr", "127.0.0.1"]
    second = slurm.nodes[1]

    healed_dir = workdir / "healed"
    job = jobs.submit([*SHAPE, "--no-kill"], [*common, "--nodes", "1:2", "--run.last_call_seconds=3",
                                                 f"--run.dir={healed_dir}"])
    output = jobs.output_file(job)
    wait_for(lambda: held_at(healed_dir, 12, 10), 480, "the run to hold after step 12", lambda: tail(output))
    hold.at(23)
    os.kill(next(pid for pid, rank in rank_processes(str(healed_dir)).items() if rank == 1), signal.SIGKILL)
    wait_for(lambda: held_at(healed_dir, 22, 20), 480, "the restarted run to hold after step 22", lambda: tail(output))
    agent = node_processes(str(healed_dir), second, ranks=False)
    assert agent, f"node {second} not running:\n{tail(output)}"
    for pid in agent:  # its agent alone: the rank must die with it
        os.kill(pid, signal.SIGKILL)
    hold.release()
    healed = jobs.wait_final(job, 600)

    strict_dir = workdir / "strict"
    hold.at(3)
    job = jobs.submit(SHAPE, [*common, f"--run.dir={strict_dir}"])
    output = jobs.output_file(job)
    wait_for(lambda: held_at(strict_dir, 2), 480, "two steps", lambda: tail(output))
    for pid in node_processes(str(strict_dir), second):
        os.kill(pid, signal.SIGKILL)
    hold.release()
    strict = jobs.wait_final(job, 300)
    strict_leftovers = sorted(rank_processes(str(strict_dir)))

    dropped_dir = workdir / "dropped"
    job = jobs.submit([*SHAPE, "--no-kill"], [*common, "--nodes", "1:2", "--run.last_call_seconds=3",
                                                 f"--run.dir={dropped_dir}", "--phase1.steps=4"])
    killed: list[int] = []
    deadline = time.monotonic() + 300
    while len(killed) < 2 and time.monotonic() < deadline and jobs.state(job).get("JobState") not in FINAL_STATES:
        started = [pid for pid in node_processes(str(dropped_dir), second)[1:] if pid not in killed]
        if started:
            time.sleep(1.0)  # in its start-up, its timer armed: the same place each time
            os.kill(started[0], signal.SIGKILL)
            killed.append(started[0])
        time.sleep(0.05)
    jobs.wait_final(job, 300)
    jobs.slurm.command("scontrol", "requeue", str(job))  # its next run must leave node 2 out
    wait_for(lambda: jobs.state(job).get("Restarts") == "1", 60, "the requeue", lambda: tail(jobs.output_file(job)))
    dropped = jobs.wait_final(job, 300)
    return SlurmFaultRecord(healed, healed_dir, elastic_reference, strict, strict_leftovers, second, dropped,
                            dropped_dir, len(killed))


def test_a_killed_rank_and_a_lost_node_heal_inside_the_allocation(slurm_faults: SlurmFaultRecord) -> None:
    job = slurm_faults.healed
    assert job.final["JobState"] == "COMPLETED" and job.final["Restarts"] == "0", (job.final, job.output[-6000:])
    lines = faults(job.output)
    # one line per fault: the rank that died, not also its peer that lost it; then the lost node
    assert len(lines) == 3, job.output[-6000:]
    assert re.match(r"launch\.sh: fault: rank 1 \(host \S+\) died of SIGKILL at phase1 step \d+; restarting from "
                    r"checkpoint phase1-step\d+ \(restart 1 of 3\)", lines[0]), lines
    assert lines[1].startswith(f"launch.sh: fault: node {slurm_faults.node} lost ") and (
        "carrying on with 1 node(s) (--nodes 1:2)" in lines[1]), lines
    assert "(restart 1 of 3)" in lines[2], lines  # past a newer checkpoint: the budget counts again from there
    assert "this job has 1" in job.output  # resumed on one rank
    assert "Traceback" not in job.output and "Force Terminated" not in job.output
    worst = slurm_faults.reference.largest_difference(slurm_faults.healed_dir)
    assert worst < 1e-4, f"largest weight difference to the uninterrupted run: {worst}"


def test_a_lost_node_without_nodes_min_max_is_one_line_and_ends_the_job(slurm_faults: SlurmFaultRecord) -> None:
    job = slurm_faults.strict
    assert job.final["JobState"] == "FAILED" and job.final["ExitCode"] == "1:0", (job.final, job.output[-6000:])
    (line,) = faults(job.output)
    assert line.startswith(f"launch.sh: error: node {slurm_faults.node} lost ") and "resume with: ./launch.sh" in line
    assert slurm_faults.strict_leftovers == [] and "Traceback" not in job.output


def test_a_node_that_fails_at_each_start_is_dropped_and_left_out_of_the_requeue(slurm_faults: SlurmFaultRecord
                                                                                ) -> None:
    job, node = slurm_faults.dropped, slurm_faults.node
    assert slurm_faults.dropped_kills == 2 and job.final["JobState"] == "COMPLETED", (job.final, job.output[-6000:])
    (dropped,) = re.findall(rf"^.*launch\.sh: fault: node {node} dropped: .*$", job.output, re.MULTILINE)
    assert "carrying on with 1 node(s) (--nodes 1:2)" in dropped, dropped
    assert "a bug" not in job.output and "Traceback" not in job.output and "launch.sh: error:" not in job.output
    # the requeued run: one line naming the node it leaves out, and its step has no task there
    (left_out,) = re.findall(r"^launch\.sh: warning: node\(s\) left out, .*$", job.output, re.MULTILINE)
    assert left_out.startswith(f"launch.sh: warning: node(s) left out, this job (SLURM job {job.job_id}) dropped "
                               f"them before: {node} (fault: node {node} dropped: "), left_out
    launches = [folder.name for folder in (slurm_faults.dropped_dir / "logs").iterdir() if folder.name[:1].isdigit()]
    per_node = Counter(name.split("-", 2)[2] for name in launches)  # TIME-node: one per launch and node
    assert per_node[node] == 1 and sorted(per_node.values()) == [1, 2], launches  # node 2: the first run only
    assert "runs again (requeue 1" in job.output
