"""Real multi-node launches on this one machine: `./launch.sh pretrain --hostfile` on "127.0.0.1" and
"localhost" (pdsh + ssh through a private sshd on loopback, one rank each, tests/support/cluster/local_cluster.py),
toy scale on CPU; skipped with the reason where this machine cannot host them.

List/dict overrides and a run folder with spaces, quotes, $ and % reach both nodes intact; killing one
node's rank ends the whole job (non-zero, no rank left behind); the rerun resumes from the checkpoint
and finishes both phases with exports. One module-scoped fixture runs the launches; the tests read
what it recorded.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster.local_cluster import LoopbackSsh
from tests.support.cluster.processes import ClusterUnavailable, free_port
from tests.support.cluster.runs import (
    PHASE1_STEPS,
    PHASE2_STEPS,
    kill_leftovers,
    latest_checkpoint,
    rank_processes,
    run_config,
    step_records,
    tail,
    wait_for,
)
from tests.support.launching import REPO_ROOT, child_env
from tests.support.pretrain_fixtures import build_shards

pytestmark = pytest.mark.cluster

# A folder name the remote shell and pdsh would mangle if unquoted: space, quotes, $, %n (pdsh: node
# rank), a brace list (bash brace expansion).
AWKWARD_NAME = "run dir/it's \"quoted\" $HOME 5%n {a,b}"
QUOTED_OVERRIDES = [
    '--run.phases=["phase1","phase2"]',
    "--phase1.gradient_accumulation_steps=1",
    '--model.overrides={"hidden_dropout_prob": 0.0}',
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("cluster_hostfile")
    build_shards(root / "shards")
    yield root
    kill_leftovers(str(root))


@pytest.fixture(scope="module")
def ssh_nodes() -> Iterator[LoopbackSsh]:
    try:
        nodes = LoopbackSsh().start()
    except ClusterUnavailable as err:
        pytest.skip(f"no loopback ssh nodes: {err}")
    yield nodes
    nodes.stop()


# ---------------------------------------------------------------------------------------------- hostfile
@dataclass
class HostfileRecord:
    """The killed launch (status, what it left) and the rerun (status, log, metrics)."""

    run_dir: Path
    killed_status: int
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
        for pid in victims:
            os.kill(pid, signal.SIGKILL)  # node "localhost" loses its rank
        # The job must end by itself: left to the surviving rank's collective it would wait
        # run.dist_timeout_minutes (120); finish() fails the test if launch.sh is still running.
        status = finish(proc, 360, killed_log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(1)  # sshd's session processes on the other "node" exit right after
    leftovers = sorted(rank_processes(str(config)))
    checkpoint, records_after_kill = latest_checkpoint(run_dir), len(step_records(run_dir))

    rerun = launch_hostfile(ssh_nodes, workdir, args, rerun_log)
    rerun_status = finish(rerun, 600, rerun_log)
    return HostfileRecord(run_dir, status, leftovers, checkpoint, records_after_kill, rerun_status,
                          tail(rerun_log, 400_000), step_records(run_dir))


def test_hostfile_overrides_reach_every_node_intact(hostfile_runs: HostfileRecord) -> None:
    assert hostfile_runs.rerun_status == 0, hostfile_runs.rerun_log[-6000:]
    resolved = json.loads((hostfile_runs.run_dir / "config.resolved.json").read_text(encoding="utf-8"))
    assert resolved["run"]["dir"] == str(hostfile_runs.run_dir)
    assert resolved["run"]["phases"] == ["phase1", "phase2"]
    assert resolved["phase1"]["gradient_accumulation_steps"] == 1
    assert resolved["resolved"]["ds_configs"]["phase1"]["gradient_accumulation_steps"] == 1
    assert resolved["resolved"]["ds_configs"]["phase2"]["gradient_accumulation_steps"] == 2  # the RUN.json's value
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
    assert record.leftovers == [], f"ranks left running after the job ended: {record.leftovers}"
    assert record.checkpoint_after_kill is not None
    tag, state = record.checkpoint_after_kill
    assert state["phase"] == "phase1" and not state["complete"], state
    # The rerun starts right after the checkpoint (steps trained after it are trained again) and runs on;
    # metrics.jsonl keeps each step once: the killed launch's rows past the checkpoint are replaced.
    assert record.records_after_kill >= state["step"]  # the killed launch had logged up to its checkpoint
    assert [r["step"] for r in record.records] == list(range(1, PHASE1_STEPS + PHASE2_STEPS + 1))
    rerun = [r for r in record.records if r["step"] > state["step"]]
    assert rerun[0]["phase"] == "phase1" and rerun[0]["phase_step"] == state["step"] + 1, (tag, rerun[:2])
    assert record.rerun_log.count("done: complete") == 2, record.rerun_log[-4000:]
    for phase in ("phase1", "phase2"):
        assert (record.run_dir / "export" / phase / "export_info.json").is_file()
