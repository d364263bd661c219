"""pretrain/launch/nodes.py and transports.py without daemons: --nodes N|MIN:MAX, the command that starts the
agents (pdsh or srun), what a node's ended session means (a lost node, or not), and each rank's CPUs under
SLURM (pin.py). The real runs: tests/launch/test_hostfile.py (pdsh + ssh) and test_slurm_faults.py (srun)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pretrain.distributed.cluster import ClusterError
from pretrain.launch.nodes import FaultLines, NodeJob, node_range
from pretrain.launch.pin import share
from pretrain.launch.transports import SSH_KEEP_ALIVE, Pdsh, Srun


def test_nodes_is_a_count_or_a_range() -> None:
    assert node_range("") is None
    assert node_range("3") == (3, 3) and node_range("03") == (3, 3)
    assert node_range("1:4") == (1, 4)
    for bad, message in (("0", "a positive integer"), ("-1", "a positive integer"), ("x", "a positive integer"),
                         ("3:2", "0 < MIN <= MAX"), ("0:2", "0 < MIN <= MAX"), ("1:", "0 < MIN <= MAX")):
        with pytest.raises(ClusterError, match=message):
            node_range(bad)


def job(min_nodes: int = 2) -> NodeJob:
    return NodeJob(["n1", "n2"], min_nodes, Pdsh("bert-job-1", ["OMP_NUM_THREADS=4", "NCCL_SOCKET_IFNAME=ib0"]),
                   ["--nproc-per-node", "8"], ["--config", "'r.json'", "--run.dir=a b"],
                   "./launch.sh pretrain --config r.json")


def test_every_node_runs_the_agent_with_its_name_and_the_job_mark() -> None:
    words = job().command()
    assert words[:6] == ["pdsh", "-S", "-f", "1024", "-w", "n1,n2"]
    remote = words[6:]
    line = " ".join(remote)
    assert line.startswith("export OMP_NUM_THREADS=4; export NCCL_SOCKET_IFNAME=ib0; cd ")
    assert "-m pretrain.launch.agent --nproc-per-node 8 --job bert-job-1 --node %h " in line
    # what a remote shell makes of it (pdsh puts the host for %h): the arguments as sent
    shown = subprocess.run(["bash", "-c", "printf '%s\\n' " + " ".join(remote[2:]).replace("%h", "n2")],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert shown[shown.index("--node") + 1] == "n2"
    assert shown[shown.index("--resume-command") + 1] == "./launch.sh pretrain --config r.json"
    assert shown[-3:] == ["--config", "r.json", "--run.dir=a b"]  # launch/plan.py's quoting, undone once


def test_under_slurm_one_task_per_node_asks_for_its_ranks_cpus_and_gpus() -> None:
    srun = Srun("bert-job-2", "77", ranks_per_node=4, cpus_per_task=6, gpus=True, python="/py")
    words = srun.command(["a", "b"], ["--nproc-per-node", "4"], ["--run.dir=a b"], "./launch.sh pretrain")
    assert words[:words.index("/py")] == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--job-name=bert-job-2", "--kill-on-bad-exit=0",
        "--export=ALL", "--cpus-per-task=24", "--gpus-per-node=4"]  # fmt: skip
    assert words[words.index("/py"):] == [
        "/py", "-u", "-m", "pretrain.launch.agent", "--nproc-per-node", "4", "--job", "bert-job-2", "--slurm",
        "--resume-command", "./launch.sh pretrain", "--", "--run.dir=a b"]  # fmt: skip  (no shell: as typed)
    # --nodes MIN:MAX: SLURM must not end the step (nor the job) when a node fails
    # no cpus-per-task in the job: one CPU per rank, SLURM's default for the task each rank used to be
    assert "--cpus-per-task=8" in Srun("m", "77", 8).command(["a"], [], [], "")
    assert "--no-kill" in Srun("m", "77", 1, may_lose_nodes=True).command(["a", "b"], [], [], "")
    assert "--no-kill" not in srun.command(["a", "b"], [], [], "")
    # a per-task GPU request of the batch job would leave each node's one task with one GPU
    os.environ["SLURM_GPUS_PER_TASK"] = "1"
    try:
        assert "SLURM_GPUS_PER_TASK" not in srun.env() and "PATH" in srun.env()
    finally:
        del os.environ["SLURM_GPUS_PER_TASK"]


def test_the_end_of_a_node_session_is_read_from_pdsh_and_srun() -> None:
    assert Pdsh.session_end("pdsh@n1: n2: ssh exited with exit code 255\n") == ("n2", 255)
    assert Pdsh.session_end("pdsh@n1: n2: ssh killed by signal 9\n") == ("n2", 128 + 9)
    assert Pdsh.session_end("n2: done: complete\n") is None
    assert Srun.session_end("srun: error: vm-2: task 1: Killed\n") == ("vm-2", 128 + signal.SIGKILL)
    assert Srun.session_end("srun: error: gpu007: task 3: Terminated\n") == ("gpu007", 128 + signal.SIGTERM)
    assert Srun.session_end("srun: error: gpu007: task 3: Exited with exit code 2\n") == ("gpu007", 2)
    assert Srun.session_end("srun: error: gpu007: tasks 0-1: Segmentation fault\n") == ("gpu007", 128 + 11)
    assert Srun.session_end("srun: Job step aborted: Waiting up to 32 seconds\n") is None


def test_a_session_that_ends_by_itself_is_no_lost_node() -> None:
    strict = job()
    for status in (0, 1, 2, 3, 4):  # the agent's own ends: done, a fault not healed, config error, NaN, disk
        assert strict.node_ended("n2", status) == []
    assert strict.lost == [] and not strict.failed


def test_a_killed_session_is_a_lost_node(capsys: pytest.CaptureFixture) -> None:
    elastic, strict = job(min_nodes=1), job()
    assert elastic.node_ended("n2", 255) == []  # carries on: nothing to stop
    assert elastic.lost == ["n2"] and not elastic.failed
    assert "carrying on with 1 node(s) (--nodes 1:2)" in capsys.readouterr().err
    assert strict.node_ended("n2", 137) == ["n1"]  # the others are stopped at once
    assert strict.failed and strict.stopping
    line = capsys.readouterr().err
    assert line.startswith("launch.sh: error: node n2 lost") and "resume with: ./launch.sh pretrain" in line
    assert strict.node_ended("n1", 143) == []  # the agent it stopped: no second line
    assert capsys.readouterr().err == ""


def test_each_rank_of_a_slurm_node_takes_its_own_block_of_the_task_cpus() -> None:
    cpus = [9, 8, 3, 2, 1, 0, 11, 10]  # as the kernel hands them: a set, no order
    blocks = [share(cpus, rank, 4) for rank in range(4)]
    assert blocks == [[0, 1], [2, 3], [8, 9], [10, 11]]
    assert share(cpus, 0, 3) == [0, 1] and share(cpus, 2, 3) == [8, 9]  # 8 CPUs, 3 ranks: 2 each, 2 left idle
    assert share([5], 1, 2) == [5]  # fewer CPUs than ranks: nothing to split


def test_a_rank_started_through_pin_runs_on_its_block() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    env = {**os.environ, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    shown = subprocess.run([sys.executable, "-m", "pretrain.launch.pin", "--", "-c",
                            "import json, os; print(json.dumps([sorted(os.sched_getaffinity(0)), os.getpid()]))"],
                           env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(shown)[0] == share(cpus, 1, 2)


def test_the_nodes_lines_on_one_failure_become_the_most_telling_one() -> None:
    out = io.StringIO()
    faults = FaultLines(out, nodes_running=lambda: 2, settle_s=60)
    tail = "; restarting from checkpoint phase1-step0000010 (restart 1 of 3); log: L\n"
    assert faults.offer(f"n1: launch.sh: fault: rank 0 (host n1) exited with status 1 at phase1 step 13{tail}")
    assert out.getvalue() == ""  # held: node n2 has not told yet
    assert not faults.offer("n1: done: complete\n")  # any other line is the caller's to print
    assert faults.offer(f"n2: launch.sh: fault: rank 1 (host n2) died of SIGKILL at phase1 step 13{tail}")
    assert out.getvalue() == f"n2: launch.sh: fault: rank 1 (host n2) died of SIGKILL at phase1 step 13{tail}"
    # the final error of both nodes: one line; with one node left, a line is shown at once
    out.truncate(0), out.seek(0)
    faults.offer("n1: launch.sh: error: rank 0 (host n1) exited with status 1 at phase1 step 20; no restart left\n")
    faults.offer("n2: launch.sh: error: rank 1 (host n2) exited with status 7 at phase1 step 20; no restart left\n")
    assert out.getvalue().startswith("n2: launch.sh: error: rank 1 (host n2) exited with status 7")
    alone = FaultLines(out, nodes_running=lambda: 1, settle_s=60)
    alone.offer("n1: launch.sh: fault: rank 0 (host n1) exited with status 1 at phase1 step 33 (restart 2 of 3)\n")
    assert out.getvalue().endswith("(restart 2 of 3)\n")


def test_a_node_that_never_tells_does_not_hold_the_line_back() -> None:
    out = io.StringIO()
    faults = FaultLines(out, nodes_running=lambda: 2, settle_s=0.2)
    faults.offer("n1: launch.sh: fault: rank 0 (host n1) made no progress in 10 min (stopped by SIGSTOP): killed"
                 " at phase1 step 3; restarting from the start (no checkpoint yet) (restart 1 of 3); log: L\n")
    deadline = time.monotonic() + 10
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "made no progress" in out.getvalue()


def test_ssh_keeps_its_sessions_alive_so_a_vanished_machine_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-o Compression=yes")  # the user's own stays, ours follows
    assert Pdsh("m").env()["PDSH_SSH_ARGS_APPEND"] == f"-o Compression=yes {SSH_KEEP_ALIVE}"
    assert "ServerAliveInterval=" in SSH_KEEP_ALIVE and "ServerAliveCountMax=" in SSH_KEEP_ALIVE


def test_after_our_own_signal_slurm_step_cancelled_lines_are_not_shown() -> None:
    srun = Srun("m", "1", 1)
    line = "slurmstepd-vm-1: error: *** STEP 7818.0 ON vm-1 CANCELLED AT 2026-12-02T04:05:37 ***\n"
    assert not srun.quiet(line)  # a user's scancel: SLURM's word stays
    srun.signalled = True
    assert srun.quiet(line) and srun.quiet("srun: Force Terminated StepId=5700.0\n")
    assert not srun.quiet("done: complete\n")
