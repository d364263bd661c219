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
from pathlib import Path

import pytest

from pretrain.distributed.cluster import ClusterError
from pretrain.launch.fault_records import FaultLines
from pretrain.launch.faults import AgentEnd, FaultRecord
from pretrain.launch.nodes import NODE_LOST_SIGNAL, NodeJob, main, node_range, relay
from pretrain.launch.pin import share
from pretrain.launch.rendezvous import is_this_machine, listen, parse_endpoint, this_machine
from pretrain.launch.transports import _END_AGENT, SSH_KEEP_ALIVE, Pdsh, SessionEnd, Srun


def test_nodes_is_a_count_or_a_range() -> None:
    assert node_range("") is None
    assert node_range("3") == (3, 3) and node_range("03") == (3, 3)
    assert node_range("1:4") == (1, 4)
    for bad, message in (("0", "a positive integer"), ("-1", "a positive integer"), ("x", "a positive integer"),
                         ("3:2", "0 < MIN <= MAX"), ("0:2", "0 < MIN <= MAX"), ("1:", "0 < MIN <= MAX")):
        with pytest.raises(ClusterError, match=message):
            node_range(bad)


def job(min_nodes: int = 2) -> NodeJob:
    return NodeJob(["n1", "n2"], min_nodes, Pdsh("bert-job-1", {"OMP_NUM_THREADS": "4", "NCCL_SOCKET_IFNAME": "ib0"}),
                   ["--nproc-per-node", "8"], ["--config", "'r.json'", "--run.dir=a b"],
                   "./launch.sh pretrain --config r.json", "127.0.0.1:29500")


def test_every_node_runs_the_agent_with_its_name_and_the_job_mark() -> None:
    words = job().command()
    assert words[:6] == ["pdsh", "-S", "-f", "1024", "-w", "n1,n2"]
    remote = words[6:]
    line = " ".join(remote)
    assert line.startswith("cd ") and "OMP_NUM_THREADS" not in line and "ib0" not in line  # the env file has them
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
    assert Pdsh.session_end("pdsh@n1: n2: ssh exited with exit code 255\n") == SessionEnd("n2", 255)
    assert Pdsh.session_end("pdsh@n1: n2: ssh killed by signal 9\n") == SessionEnd("n2", 128 + 9)
    assert Pdsh.session_end("n2: done: complete\n") is None
    assert Srun.session_end("srun: error: vm-2: task 1: Killed\n") == SessionEnd("vm-2", 128 + signal.SIGKILL)
    assert Srun.session_end("srun: error: gpu007: task 3: Terminated\n") == SessionEnd("gpu007", 128 + signal.SIGTERM)
    assert Srun.session_end("srun: error: gpu007: task 3: Exited with exit code 2\n") == SessionEnd("gpu007", 2)
    assert Srun.session_end("srun: error: gpu007: tasks 0-1: Segmentation fault\n") == SessionEnd("gpu007", 128 + 11)
    assert Srun.session_end("srun: Job step aborted: Waiting up to 32 seconds\n") is None
    # what SLURM says of a node it declared failed, and of a task whose memory ran out: read as such
    failed = Srun.session_end("srun: error: Node failure on gpu009\n")
    assert failed is not None and failed.host == "gpu009" and failed.why == "SLURM declared the node failed"
    oom = Srun.session_end("srun: error: gpu007: task 0: Out Of Memory\n")
    assert oom is not None and oom.why == "SLURM reports its task out of memory" and oom.status >= 128


def test_a_session_that_ends_by_itself_after_a_verdict_or_well_is_no_lost_node() -> None:
    strict = job()
    assert strict.node_ended(SessionEnd("n1", 0)) is None  # done
    strict.verdict = True  # a node's final verdict: the others end because of it (closed rendezvous: status 1)
    for status in (1, 2, 3, 4):  # the agents' own ends: a fault not healed, config error, NaN, disk
        assert strict.node_ended(SessionEnd("n2", status)) is None
    assert strict.lost == [] and not strict.failed
    # an agent that said it ended by itself (4: a save failed, after its verdict) is no lost node, whatever srun says
    told = job()
    told.verdict, told.agents_ended["n2"] = True, 4
    assert told.node_ended(SessionEnd("n2", 137, "SLURM reports its task out of memory")) is None
    assert told.lost == [] and told.ended == {"n2": 4}


def test_a_node_that_ends_by_itself_before_any_verdict_is_a_node_fault_with_its_last_line(
        capsys: pytest.CaptureFixture) -> None:
    """An agent that could not start (a node without the mount or the venv) would leave the others waiting in the
    rendezvous for its join timeout: without MIN:MAX they are stopped at once, its last line quoted; with it, the
    job carries on without that node. Its last line comes from pdsh's prefix, or its agent's last word."""
    strict = job()
    out = io.StringIO()
    relay(io.StringIO("n2: FileNotFoundError: [Errno 2] No such file or directory: '/scratch/x'\n"
                      "n1: an ordinary line\n"), out, strict, FaultLines(out, lambda: 2))
    assert strict.node_ended(SessionEnd("n2", 1)) == (signal.SIGTERM, ["n1"])
    assert strict.failed and strict.stopping and strict.lost == ["n2"]
    line = capsys.readouterr().err
    assert line.startswith("launch.sh: error: node n2 ended by itself with status 1 before the job's end "
                           "(FileNotFoundError: [Errno 2] No such file or directory: '/scratch/x'); stopping"), line
    assert strict.node_ended(SessionEnd("n1", 143)) is None and capsys.readouterr().err == ""
    elastic = job(min_nodes=1)
    relay(io.StringIO(AgentEnd("n1", 2, "config error: run.json: no such file").to_line() + "\n"), out, elastic,
          FaultLines(out, lambda: 2))
    assert elastic.node_ended(SessionEnd("n1", 2)) == (NODE_LOST_SIGNAL, ["n2"])
    assert not elastic.failed and elastic.lost == ["n1"]
    line = capsys.readouterr().err
    assert "node n1 ended by itself with status 2 before the job's end (config error: run.json: no such file); " \
           "carrying on with 1 node(s) (--nodes 1:2)" in line, line


def test_a_killed_session_is_a_lost_node(capsys: pytest.CaptureFixture) -> None:
    elastic, strict = job(min_nodes=1), job()
    # carries on: the survivors' agents are told at once, to restart their ranks without it
    assert elastic.node_ended(SessionEnd("n1", 255)) == (NODE_LOST_SIGNAL, ["n2"])
    assert elastic.lost == ["n1"] and not elastic.failed
    assert "node n1 lost" in (err := capsys.readouterr().err) and "carrying on with 1 node(s) (--nodes 1:2)" in err
    assert strict.node_ended(SessionEnd("n2", 137)) == (signal.SIGTERM, ["n1"])  # the others are stopped at once
    assert strict.failed and strict.stopping
    line = capsys.readouterr().err
    assert line.startswith("launch.sh: error: node n2 lost") and "resume with: ./launch.sh pretrain" in line
    assert strict.node_ended(SessionEnd("n1", 143)) is None  # the agent it stopped: no second line
    assert capsys.readouterr().err == ""
    oom = job(min_nodes=1)
    oom.node_ended(SessionEnd("n2", 137, "SLURM reports its task out of memory"))
    assert "(its session ended with status 137: SLURM reports its task out of memory)" in capsys.readouterr().err


def test_the_stores_death_stops_the_job_with_one_line(capsys: pytest.CaptureFixture) -> None:
    sent = []
    running = job(min_nodes=1)
    running.transport = type("T", (), {"signal": lambda self, signum, hosts: sent.append((signum, list(hosts)))})()
    running.store_ended(-signal.SIGKILL)
    line = capsys.readouterr().err
    assert line.startswith("launch.sh: error: the rendezvous store of this job (127.0.0.1:29500, on this machine) "
                           "ended") and "resume with: ./launch.sh pretrain" in line
    assert running.failed and sent == [(signal.SIGTERM, ["n1", "n2"])]


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


def record(host: str, rank: int, cause: str, order: int, restart: int = 0, restarts: bool = True) -> str:
    """A node's fault record as its agent prints it, pdsh's node name in front."""
    line = f"{'fault' if restarts else 'error'}: rank {rank} (host {host}) {cause} at phase1 step 13; ..."
    made = FaultRecord(time.time(), "job", host, restart, "x", rank, cause, "phase1 step 13", None, None, restarts,
                       0 if restarts else 1, order, line)
    return f"{host}: launch.sh: fault record: {made.to_json()}\n"


def test_the_nodes_records_of_one_failure_become_the_most_telling_line() -> None:
    out = io.StringIO()
    faults = FaultLines(out, nodes_running=lambda: 2, settle_s=60)
    assert faults.offer(record("n1", 0, "exited with status 1", 5))
    assert out.getvalue() == ""  # held: node n2 has not told yet
    assert not faults.offer("n1: done: complete\n")  # any other line is the caller's to print
    assert faults.offer(record("n2", 1, "died of SIGKILL", 2))
    assert out.getvalue() == "n2: launch.sh: fault: rank 1 (host n2) died of SIGKILL at phase1 step 13; ...\n"
    # a final verdict on one node ends the job (it closes the rendezvous): its line, not another's restart
    out.truncate(0), out.seek(0)
    faults.offer(record("n1", 0, "died of SIGKILL", 2, restart=1))
    faults.offer(record("n2", 1, "exited with status 1", 5, restart=1, restarts=False))
    assert out.getvalue().startswith("n2: launch.sh: error: rank 1 (host n2) exited with status 1")
    # a node that does not tell (its ranks restarted for the other's rendezvous): the next event shows the line first
    out.truncate(0), out.seek(0)
    faults.offer(record("n1", 0, "died of SIGKILL", 2, restart=2))
    faults.offer(record("n1", 0, "made no progress", 0, restart=3))
    assert out.getvalue().startswith("n1: launch.sh: fault: rank 0 (host n1) died of SIGKILL")
    faults.show_all()
    out.truncate(0), out.seek(0)
    faults.offer(record("n2", 1, "exited with status 1", 5, restart=2))  # too late: attempt 2 was told
    faults.show_all()
    assert out.getvalue() == ""
    alone = FaultLines(out, nodes_running=lambda: 1, settle_s=60)
    alone.offer(record("n1", 0, "exited with status 1", 5, restart=2))
    assert out.getvalue().endswith("exited with status 1 at phase1 step 13; ...\n")


def test_a_node_that_never_tells_does_not_hold_the_line_back() -> None:
    out = io.StringIO()
    faults = FaultLines(out, nodes_running=lambda: 2, settle_s=0.2)
    faults.offer(record("n1", 0, "made no progress in 10 min (stopped by SIGSTOP; x): killed", 0))
    deadline = time.monotonic() + 10
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "made no progress" in out.getvalue()


def test_a_node_that_ends_by_itself_does_not_cut_the_other_nodes_word_short() -> None:
    out = io.StringIO()
    strict = job()
    faults = FaultLines(out, lambda: strict.nodes_left, settle_s=60)
    lines = io.StringIO(record("n2", 1, "died of SIGKILL", 2, restarts=False) + "pdsh@n1: n2: ssh exited with exit code 1\n"
                        + record("n1", 0, "exited with status 1", 5, restarts=False))
    relay(lines, out, strict, faults)
    assert out.getvalue().count("launch.sh: error:") == 1 and "died of SIGKILL" in out.getvalue()


def test_an_agents_last_word_is_noted_not_shown() -> None:
    """After its verdict (a config error its ranks found: exit 2, never restarted), an agent's end is no node fault."""
    elastic = job(min_nodes=1)
    out = io.StringIO()
    lines = io.StringIO(record("n2", 0, "config error", 1, restarts=False) + f"n2: {AgentEnd('n2', 2).to_line()}\n"
                        "pdsh@n1: n2: ssh exited with exit code 2\n")
    faults = FaultLines(out, lambda: 2)
    relay(lines, out, elastic, faults)
    faults.show_all()  # the other node's word on it never comes here
    assert out.getvalue().count("launch.sh: error: rank 0 (host n2) config error") == 1
    assert "agent end" not in out.getvalue() and elastic.agents_ended == {"n2": 2} and elastic.lost == []


def test_the_rendezvous_endpoint_is_parsed_and_this_machine_told_by_binding() -> None:
    assert parse_endpoint("login1:29500") == ("login1", 29500) and parse_endpoint("[::1]:7") == ("::1", 7)
    for bad in ("login1", "login1:0", "login1:70000", ":29500", "a b:1"):
        with pytest.raises(ClusterError, match="--rdzv-endpoint must be HOST:PORT"):
            parse_endpoint(bad)
    assert is_this_machine("127.0.0.1") and is_this_machine("localhost")
    assert not is_this_machine("192.0.2.1") and not is_this_machine("no-such-host.invalid")
    assert this_machine(["127.0.0.1", "localhost"]) == "127.0.0.1"  # a rehearsal on one machine
    assert is_this_machine(this_machine(["192.0.2.1"]))  # the route's source address toward a node
    with listen(0) as sock:
        with pytest.raises(ClusterError, match=f"rendezvous port {sock.getsockname()[1]} of this machine"):
            listen(sock.getsockname()[1])


def test_an_endpoint_elsewhere_that_nobody_serves_is_one_line_before_any_node_starts(
        tmp_path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    with listen(0) as sock:  # a port nothing listens on once this closes
        port = sock.getsockname()[1]
    monkeypatch.setattr("pretrain.launch.store_reach.is_this_machine", lambda host: False)  # as if another machine
    hosts = tmp_path / "hosts"
    hosts.write_text("n1 slots=1\nn2 slots=1\n")
    status = main(["--hostfile", str(hosts), "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--", "--config", "r.json"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"launch.sh: error: --rdzv-endpoint 127.0.0.1:{port}: no rendezvous store answers there")


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


def test_the_drop_kills_that_nodes_agent_alone(tmp_path: Path) -> None:
    """The pattern Pdsh.drop hands pkill, tried with pgrep on two stand-in agents of one machine (hosts n1, n10)."""
    package = tmp_path / "pretrain" / "launch"
    package.mkdir(parents=True)
    for init in (tmp_path / "pretrain" / "__init__.py", package / "__init__.py"):
        init.write_text("")
    (package / "agent.py").write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(60)\n")
    agents = {host: subprocess.Popen([sys.executable, "-u", "-m", "pretrain.launch.agent", "--nnodes", "1:2",
                                      "--job", "bert-job-1", "--node", host, "--", "--config", "x"], cwd=tmp_path,
                                     stdout=subprocess.PIPE, text=True) for host in ("n1", "n10")}
    try:
        for agent in agents.values():
            assert agent.stdout is not None and agent.stdout.readline() == "up\n"
        found = subprocess.run(["pgrep", "-f", Pdsh("bert-job-1").agent_pattern("n1")], capture_output=True,
                               text=True, check=False).stdout.split()
        assert found == [str(agents["n1"].pid)]
    finally:
        for agent in agents.values():
            agent.kill()
            agent.wait()


def test_under_slurm_the_drop_kills_that_nodes_agent_alone(tmp_path: Path) -> None:
    """What Srun.drop runs on the node (through an overlapping step), tried on two stand-in agents of one machine
    that differ only in their SLURM node (two slurmd on one machine, as the local test cluster has)."""
    package = tmp_path / "pretrain" / "launch"
    package.mkdir(parents=True)
    for init in (tmp_path / "pretrain" / "__init__.py", package / "__init__.py"):
        init.write_text("")
    (package / "agent.py").write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(60)\n")
    agents = {node: subprocess.Popen([sys.executable, "-u", "-m", "pretrain.launch.agent", "--job", "bert-job-1",
                                      "--slurm", "--", "--config", "x"], cwd=tmp_path, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "SLURMD_NODENAME": node}) for node in ("vm-1", "vm-2")}
    try:
        for agent in agents.values():
            assert agent.stdout is not None and agent.stdout.readline() == "up\n"
        subprocess.run([sys.executable, "-c", _END_AGENT.format(mark="bert-job-1")], check=True,
                       env={**os.environ, "SLURMD_NODENAME": "vm-2"})
        assert agents["vm-2"].wait(timeout=10) == -signal.SIGKILL
        assert agents["vm-1"].poll() is None
    finally:
        for agent in agents.values():
            agent.kill()
            agent.wait()
