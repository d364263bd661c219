"""Real multi-node launches on this one machine: `./launch.sh pretrain --hostfile` on "127.0.0.1" and
"localhost" (pdsh + ssh through a private sshd on loopback, one rank each, tests/support/cluster/local_cluster.py),
toy scale on CPU; skipped with the reason where this machine cannot host them. Every node runs our elastic
agent (pretrain/launch/nodes.py, agent.py).

List/dict overrides and a run folder with spaces, quotes, $ and % reach both nodes intact; with restarts off,
killing one node's rank ends the whole job (non-zero, no rank left behind); the rerun resumes from the
checkpoint and finishes both phases with exports. One module-scoped fixture runs those launches; the tests
read what it recorded. With `--nodes 1:2`, the first node (rank 0's, where the rendezvous store used to live) loses
its agent alone: its rank dies with it, the survivor is told at once, and the job carries on with one rank to the
weights of an uninterrupted run, to float rounding; without `--nodes MIN:MAX`, a node lost (its agent and rank
killed) is one line naming it. Each act waits for the run to hold at a step (tests/support/launching.py Hold).
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

from pretrain.distributed.cluster import ClusterError
from pretrain.launch.faults import FaultHistory
from pretrain.launch.nodes import NodeJob, say
from pretrain.launch.processes import running
from pretrain.launch.rendezvous import listen
from pretrain.launch.store_reach import check_before_start
from pretrain.launch.transports import Pdsh
from pretrain.run_folder import faults_dir
from tests.launch.conftest import ElasticReference
from tests.support.cluster.local_cluster import LoopbackSsh
from tests.support.cluster.processes import free_port, parent, process_environ, processes_mentioning
from tests.support.cluster.runs import (
    PHASE2_STEPS,
    kill_leftovers,
    latest_checkpoint,
    rank_processes,
    run_config,
    step_records,
    tail,
    wait_for,
)
from tests.support.launching import REPO_ROOT, Hold, child_env
from tests.support.pretrain_fixtures import build_shards

pytestmark = pytest.mark.cluster

# A folder name the remote shell and pdsh would mangle if unquoted: space, quotes, $, %n (pdsh: node
# rank), a brace list (bash brace expansion).
AWKWARD_NAME = "run dir/it's \"quoted\" $HOME 5%n {a,b}"
# --nodes 1:2 with one node left: its rendezvous waits this long for the other (run.last_call_seconds, 30 by default)
LAST_CALL = "--run.last_call_seconds=3"
QUOTED_OVERRIDES = [
    '--run.phases=["phase1","phase2"]',
    "--phase1.gradient_accumulation_steps=1",
    '--model.overrides={"hidden_dropout_prob": 0.0}',
]
# The overrides run's phase 1: killed after the checkpoint of step 10, resumed from it; steps past that only cost time
PHASE1_STEPS = 16


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("cluster_hostfile")
    build_shards(root / "shards")
    yield root
    kill_leftovers(str(root))


# ---------------------------------------------------------------------------------------------- hostfile
@dataclass
class HostfileRecord:
    """The killed launch (status, what it left) and the rerun (status, log, metrics)."""

    run_dir: Path
    killed_status: int
    killed_log: str
    leftovers: list[int]
    checkpoint_after_kill: tuple[str, dict[str, Any]] | None
    records_after_kill: int
    rerun_status: int
    rerun_log: str
    records: list[dict[str, Any]]
    rank_envs: list[dict[str, str]]  # the environment of each node's rank, read while the run held


def launch_hostfile(ssh: LoopbackSsh, workdir: Path, args: list[str], log: Path,
                    hold: Hold | None = None) -> subprocess.Popen[bytes]:
    env = {**child_env(), **ssh.env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(hold.env if hold else {})}
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
                        run={"phases": ["phase1"]}, phase1={"steps": PHASE1_STEPS})
    args = ["--config", str(config), f"--run.dir={run_dir}", *QUOTED_OVERRIDES]
    killed_log, rerun_log = workdir / "hostfile-killed.log", workdir / "hostfile-rerun.log"

    hold = Hold(workdir / "hold-hostfile").at(13)
    proc = launch_hostfile(ssh_nodes, workdir, [*args, "--run.max_restarts=0"], killed_log, hold)
    try:
        wait_for(lambda: held_after_the_first_checkpoint(run_dir) or proc.poll() is not None, 480,
                 "the run to hold after its first checkpoint", lambda: tail(killed_log))
        rank_envs = [process_environ(pid) for pid in rank_processes(str(config))]
        victims = [pid for pid, rank in rank_processes(str(config)).items() if rank == 1]
        assert proc.poll() is None and victims, f"the run ended before the kill:\n{tail(killed_log)}"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)  # node "localhost" loses its rank
        hold.release()
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
    return HostfileRecord(run_dir, status, tail(killed_log, 400_000), leftovers, checkpoint, records_after_kill,
                          rerun_status,
                          tail(rerun_log, 400_000), step_records(run_dir), rank_envs)


def held_at(run_dir: Path, step: int) -> bool:
    """Step `step` logged (the hold stops the ranks before the next), and with step 12 the checkpoint of step 10."""
    records = step_records(run_dir)
    return bool(records) and records[-1]["step"] >= step and (step < 12 or latest_checkpoint(run_dir) is not None)


def held_after_the_first_checkpoint(run_dir: Path) -> bool:
    """Step 12 logged (the hold stops the ranks before step 13), the checkpoint of step 10 whole."""
    records = step_records(run_dir)
    return latest_checkpoint(run_dir) is not None and bool(records) and records[-1]["step"] >= 12


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
    # config.resolved.json is rank 0's view; each node's agent log says what its rank got (a Python list).
    argv_by_node = {}
    for log in sorted((hostfile_runs.run_dir / "logs").glob("*/agent.log")):  # by time: the rerun's last
        spawned = re.findall(r" ranks run: (\[.*\])$", log.read_text(encoding="utf-8"), re.MULTILINE)
        argv_by_node[log.parent.name.rpartition("-")[2]] = ast.literal_eval(spawned[-1])[-4:]
    expected = [f"--run.dir={hostfile_runs.run_dir}", *QUOTED_OVERRIDES]
    assert argv_by_node == {"127.0.0.1": expected, "localhost": expected}, argv_by_node


def left_in_the_checkout(*patterns: str, wait_s: float = 600) -> list[Path]:
    """The folders matching `patterns` in the checkout that outlive `wait_s`. This run's launches have ended, so a
    folder of theirs never goes; another launch from the checkout, running beside this one in the other pytest
    worker, removes its own when it ends."""
    present = [path for pattern in patterns for path in REPO_ROOT.glob(pattern)]
    deadline = time.monotonic() + wait_s
    while (present := [path for path in present if path.exists()]) and time.monotonic() < deadline:
        time.sleep(1)
    return present


def test_hostfile_launch_leaves_no_env_file_behind(hostfile_runs: HostfileRecord) -> None:
    """launch.sh writes its rank variables to a DS_ENV_FILE for the runner; one per launch must not pile up."""
    env_files = re.findall(r"^\+ export DS_ENV_FILE=(\S+)$", hostfile_runs.rerun_log, re.MULTILINE)
    assert len(env_files) == 1, env_files
    assert not Path(env_files[0]).exists(), env_files
    # nor the 0600 copy pretrain.launch.nodes ships to the nodes in the working folder (pretrain/launch/node_env.py),
    # nor the job's rendezvous key (pretrain/launch/rendezvous_key.py), which every agent read to sign its states
    assert not left_in_the_checkout(".bert-ds-env-*", ".bert-ds-rendezvous-*")
    # every node's rank got its variables from that file: PYTHONSAFEPATH keeps the working folder off its imports
    assert len(hostfile_runs.rank_envs) == 2, hostfile_runs.rank_envs
    assert all(env.get("PYTHONSAFEPATH") == "1" and env.get("TOKENIZERS_PARALLELISM") == "false"
               for env in hostfile_runs.rank_envs)


def test_hostfile_killed_node_ends_the_job_and_the_rerun_resumes(hostfile_runs: HostfileRecord) -> None:
    record = hostfile_runs
    assert record.killed_status != 0
    assert record.leftovers == [], f"ranks left running after the job ended: {record.leftovers}"
    # Both nodes' agents word the failure; the terminal shows one line: the rank that was killed, not its peer
    # that lost it (pretrain/launch/nodes.py FaultLines), pdsh's node name in front.
    (line,) = re.findall(r"^.*launch\.sh: (?:fault|error): .*$", record.killed_log, re.MULTILINE)
    assert re.match(r"(\S+): launch\.sh: error: rank 1 \(host \1\) died of SIGKILL at phase1 step \d+; "
                    r"no restart left \(run.max_restarts=0\)", line), line
    # The other node's record, judged from its rank's real log (gloo's lost-peer traceback), is a victim's: never
    # "the same failure again", never the line shown (pretrain/launch/fault_texts.py).
    survivor = [r for r in FaultHistory(faults_dir(record.run_dir)).records() if r.rank == 0]
    assert survivor and all(r.victim for r in survivor), survivor
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


# ---------------------------------------------------------------------------------------------- lost node
def kill_node(marker: str, node: str, ranks: bool = True) -> tuple[list[int], list[int]]:
    """SIGKILL the agent of hostfile node `node` (its command line says `--node NODE`), and with `ranks` its ranks too
    (a machine that dies takes both); returns the agents' and the ranks' pids."""
    agents = []
    for pid in processes_mentioning(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"python" in argv[0] and b"pretrain.launch.agent" in argv and b"--node" in argv  # not pdsh's ssh
                and argv[argv.index(b"--node") + 1] == node.encode()):
            agents.append(pid)
    children = [pid for pid in rank_processes(marker) if any(parent(pid) == agent for agent in agents)]
    for pid in [*agents, *(children if ranks else [])]:
        os.kill(pid, signal.SIGKILL)
    return agents, children


def alive(pid: int) -> bool:
    return running(pid)  # gone, or dead and not yet reaped: not running


@dataclass
class LostNodeRecord:
    elastic_status: int
    elastic_log: str
    elastic_dir: Path
    reference: ElasticReference
    orphans: list[int]  # the first node's ranks, alive a moment after their agent was killed
    strict_status: int
    strict_log: str
    strict_leftovers: list[int]


@pytest.fixture(scope="module")
def lost_node_runs(ssh_nodes: LoopbackSsh, workdir: Path, elastic_reference: ElasticReference) -> LostNodeRecord:
    """With --nodes 1:2 the first node, 127.0.0.1 (rank 0's), loses its agent alone; without it, node "localhost"
    loses agent and rank: the first once the run holds after its first checkpoint, the second after two steps (its
    job ends there). The first is compared with the uninterrupted run on this machine's 2 ranks
    (tests/launch/conftest.py: the same steps on 1 or 2 ranks)."""
    config = elastic_reference.config
    record: dict[str, Any] = {}
    # the elastic run loses its node after its first checkpoint (it resumes from it); the strict one, whose job
    # ends, after two steps
    for name, extra, node, at in (("elastic", ["--nodes", "1:2", LAST_CALL], "127.0.0.1", 13),
                                  ("strict", [], "localhost", 3)):
        run_dir, log, hold = workdir / "lost" / name, workdir / f"lost-{name}.log", Hold(workdir / f"hold-{name}").at(at)
        proc = launch_hostfile(ssh_nodes, workdir, [*extra, "--config", str(config), f"--run.dir={run_dir}"], log,
                               hold)
        try:
            wait_for(lambda: held_at(run_dir, at - 1) or proc.poll() is not None, 480,  # noqa: B023
                     f"the run to hold after step {at - 1}", lambda: tail(log))  # noqa: B023
            agents, ranks = kill_node(str(run_dir), node, ranks=name == "strict")
            assert agents and ranks, f"node {node} not found running:\n{tail(log)}"
            time.sleep(1)
            record[f"{name}_orphans"] = [pid for pid in ranks if alive(pid)]
            hold.release()
            record[name] = (finish(proc, 480, log), tail(log, 400_000))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(1)
        record[f"{name}_leftovers"] = sorted(rank_processes(str(run_dir)))
    return LostNodeRecord(*record["elastic"], workdir / "lost" / "elastic", elastic_reference, record["elastic_orphans"],
                          *record["strict"], record["strict_leftovers"])


def test_losing_the_first_nodes_agent_with_nodes_min_max_carries_on_to_the_same_weights(
        lost_node_runs: LostNodeRecord) -> None:
    """The node that held rank 0 loses its agent alone: its rank dies with it (a node fault, not a stop), the
    survivor's agent restarts at once, and the job ends as an uninterrupted run does."""
    record = lost_node_runs
    assert record.orphans == [], f"ranks outlived their agent: {record.orphans}"
    assert record.elastic_status == 0, record.elastic_log[-6000:]
    lost = re.findall(r"^launch\.sh: fault: node 127\.0\.0\.1 lost .*$", record.elastic_log, re.MULTILINE)
    assert len(lost) == 1 and "carrying on with 1 node(s) (--nodes 1:2)" in lost[0], record.elastic_log[-6000:]
    (restart,) = re.findall(r"^localhost: launch\.sh: fault: rank \d .*$", record.elastic_log, re.MULTILINE)
    assert "(restart 1 of 3)" in restart and "restarting from checkpoint phase1-step0000010" in restart, restart
    assert "this job has 1" in record.elastic_log  # resumed on one rank
    assert "Traceback" not in record.elastic_log and "done: SIG" not in record.elastic_log  # no stop, no checkpoint
    worst = record.reference.largest_difference(record.elastic_dir)
    assert worst < 1e-4, f"largest weight difference to the uninterrupted run: {worst}"


def test_a_lost_node_without_nodes_min_max_is_one_line_and_stops_the_job(lost_node_runs: LostNodeRecord) -> None:
    record = lost_node_runs
    assert record.strict_status == 1, record.strict_log[-6000:]
    (line,) = re.findall(r"^launch\.sh: error: .*$", record.strict_log, re.MULTILINE)
    assert line.startswith("launch.sh: error: node localhost lost ") and "resume with: ./launch.sh pretrain" in line
    assert record.strict_leftovers == [] and "Traceback" not in record.strict_log


# ---------------------------------------------------------------------------------------------- a node that never starts
@dataclass
class NeverStartedRecord:
    strict_status: int
    strict_log: str
    strict_leftovers: list[int]
    elastic_status: int
    elastic_log: str
    elastic_dir: Path


@pytest.fixture(scope="module")
def never_started_runs(ssh_nodes: LoopbackSsh, workdir: Path, elastic_reference: ElasticReference
                       ) -> NeverStartedRecord:
    """Node "localhost" gets a TMPDIR that does not exist (a node without its scratch mount): its agent cannot make
    its timer pipe and ends with status 1 before it joins. Without --nodes MIN:MAX, then with --nodes 1:2."""
    record: dict[str, Any] = {}
    with ssh_nodes.planted_env("localhost", "TMPDIR", str(workdir / "no-such-scratch")):
        for name, extra in (("strict", []), ("elastic", ["--nodes", "1:2", LAST_CALL])):
            run_dir, log = workdir / "never" / name, workdir / f"never-{name}.log"
            proc = launch_hostfile(ssh_nodes, workdir, [*extra, "--config", str(elastic_reference.config),
                                                        f"--run.dir={run_dir}"], log)
            # without MIN:MAX the other node would wait in the rendezvous for its join timeout (600 s)
            record[name] = (finish(proc, 300 if name == "strict" else 480, log), tail(log, 400_000))
            time.sleep(1)
            record[f"{name}_leftovers"] = sorted(rank_processes(str(run_dir)))
    return NeverStartedRecord(*record["strict"], record["strict_leftovers"], *record["elastic"],
                              workdir / "never" / "elastic")


def test_a_node_that_cannot_start_stops_the_job_at_once_with_its_own_line(never_started_runs: NeverStartedRecord
                                                                          ) -> None:
    record = never_started_runs
    assert record.strict_status == 1, record.strict_log[-6000:]
    (line,) = re.findall(r"^launch\.sh: error: .*$", record.strict_log, re.MULTILINE)
    assert line.startswith("launch.sh: error: node localhost ended by itself with status 1 before the job's end "
                           "(error: the agent could not start: FileNotFoundError: "), line
    assert "stopping the other node(s)" in line and "resume with: ./launch.sh pretrain" in line, line
    assert "rendezvous" not in record.strict_log and "Traceback" not in record.strict_log, record.strict_log[-6000:]
    assert record.strict_leftovers == []


def test_with_nodes_min_max_the_job_goes_on_without_a_node_that_cannot_start(never_started_runs: NeverStartedRecord,
                                                                          elastic_reference: ElasticReference) -> None:
    record = never_started_runs
    assert record.elastic_status == 0, record.elastic_log[-6000:]
    (line,) = re.findall(r"^launch\.sh: fault: node localhost .*$", record.elastic_log, re.MULTILINE)
    assert "ended by itself with status 1 before the job's end" in line and "carrying on with 1 node(s)" in line
    assert record.elastic_log.count("done: complete") == 1 and "Traceback" not in record.elastic_log
    worst = elastic_reference.largest_difference(record.elastic_dir)
    assert worst < 1e-4, f"largest weight difference to the uninterrupted run: {worst}"


def test_before_any_agent_starts_a_node_reaches_the_store_and_this_machine_is_named(
        ssh_nodes: LoopbackSsh, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """From the first node, over pdsh + ssh as the agents are started: a store that answers, and one that nobody
    serves (a firewall's refusal); and, under --nodes MIN:MAX, this machine named as the one node the job cannot
    lose when it is a node and serves the store."""
    monkeypatch.setenv("PATH", ssh_nodes.env["PATH"])
    transport = Pdsh("bert-job-check")
    served = listen(free_port())
    try:
        port = served.getsockname()[1]
        assert transport.store_problem("localhost", ("127.0.0.1", port)) is None
        check_before_start(NodeJob(["127.0.0.1", "localhost"], 1, transport, [], [], "again", f"127.0.0.1:{port}"),
                           True, say)
        assert "warning: this machine (127.0.0.1) is a node of the job and serves its rendezvous store: losing it " \
               "ends the job" in capsys.readouterr().err
        check_before_start(NodeJob(["127.0.0.1", "localhost"], 2, transport, [], [], "again", f"127.0.0.1:{port}"),
                           True, say)
        assert capsys.readouterr().err == ""  # without MIN:MAX every node is one the job cannot lose: nothing to add
    finally:
        served.close()
    nobody = free_port()
    with pytest.raises(ClusterError, match=rf"1 of 1 node\(s\) cannot reach the rendezvous store at 127\.0\.0\.1:"
                                           rf"{nobody}: localhost \(.*Connection refused.*\); 0 can, the job needs 1"):
        check_before_start(NodeJob(["localhost"], 1, transport, [], [], "again", f"127.0.0.1:{nobody}"), False, say)
    # a node that is down (its name resolves nowhere: pdsh's ssh fails) no longer refuses a --nodes 1:2 launch: it
    # starts on the node that reaches the store, the other named; every node is asked, not the first alone
    served = listen(free_port())
    try:
        job = NodeJob(["down.invalid", "localhost"], 1, transport, [], [], "again",
                      f"127.0.0.1:{served.getsockname()[1]}")
        job.hosts = check_before_start(job, False, say)
    finally:
        served.close()
    assert job.hosts == ["localhost"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("launch.sh: warning: node(s) left out, they cannot reach the rendezvous store at ")
    assert "down.invalid (" in line and "starting on the 1 that can (--nodes 1:2)" in line



# ---------------------------------------------------------------------------------------------- a bad node
@dataclass
class BadNodeRecord:
    status: int
    log: str
    killed: list[int]
    leftovers: list[int]


def node_ranks(marker: str, node: str) -> list[int]:
    """The ranks whose agent is hostfile node `node`'s (its command line says `--node NODE`)."""
    agents = set()
    for pid in processes_mentioning(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"python" in argv[0] and b"pretrain.launch.agent" in argv and b"--node" in argv
                and argv[argv.index(b"--node") + 1] == node.encode()):
            agents.add(pid)
    return [pid for pid in rank_processes(marker) if parent(pid) in agents]


@pytest.fixture(scope="module")
def bad_node_run(ssh_nodes: LoopbackSsh, workdir: Path, elastic_reference: ElasticReference) -> BadNodeRecord:
    """Under --nodes 1:2, node "localhost"'s rank dies the same way at each start (SIGKILL a second into its
    start-up, as a GPU that fails there would end it): twice, then the node must be gone. A short run (4 steps)."""
    run_dir, log = workdir / "bad" / "elastic", workdir / "bad-elastic.log"
    proc = launch_hostfile(ssh_nodes, workdir, ["--nodes", "1:2", LAST_CALL, "--config", str(elastic_reference.config),
                                                f"--run.dir={run_dir}", "--phase1.steps=4"], log)
    killed: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and len(killed) < 2 and time.monotonic() < deadline:
            started = [pid for pid in node_ranks(str(run_dir), "localhost") if pid not in killed]
            if started:
                time.sleep(1.0)  # in its start-up, its timer armed: the same place each time
                os.kill(started[0], signal.SIGKILL)
                killed.append(started[0])
            time.sleep(0.05)
        status = finish(proc, 300, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(1)
    return BadNodeRecord(status, tail(log, 400_000), killed, sorted(rank_processes(str(run_dir))))


def test_a_node_that_fails_the_same_way_at_each_start_is_dropped_and_the_job_finishes(bad_node_run: BadNodeRecord
                                                                                       ) -> None:
    """The same failure twice on one host, no checkpoint between: a drop (one line naming it and why), never 'the
    same failure again ... a bug'; the other node finishes the run alone."""
    record = bad_node_run
    assert len(record.killed) == 2, record.log[-6000:]
    assert record.status == 0, record.log[-6000:]
    (dropped,) = re.findall(r"^.*launch\.sh: fault: node localhost dropped: .*$", record.log, re.MULTILINE)
    assert "(host localhost) died of SIGKILL during start-up: the same failure as at the start before" in dropped \
        or "its rank failed at 2 starts with no newer checkpoint between" in dropped, dropped
    assert "carrying on with 1 node(s) (--nodes 1:2)" in dropped, dropped
    assert "a bug" not in record.log and "Traceback" not in record.log and "launch.sh: error:" not in record.log
    assert record.log.count("done: complete") == 1, record.log[-6000:]
    assert record.leftovers == []
