"""pretrain/launch/nodes.py without daemons: --nodes N|MIN:MAX, the remote command each node's shell gets, and
what a node's ended session means (a lost node, or not). The real pdsh + ssh runs are tests/launch/test_hostfile.py."""

from __future__ import annotations

import subprocess

import pytest

from pretrain.launch.cluster import ClusterError
from pretrain.launch.nodes import NodeJob, node_range


def test_nodes_is_a_count_or_a_range() -> None:
    assert node_range("") is None
    assert node_range("3") == (3, 3) and node_range("03") == (3, 3)
    assert node_range("1:4") == (1, 4)
    for bad, message in (("0", "a positive integer"), ("-1", "a positive integer"), ("x", "a positive integer"),
                         ("3:2", "0 < MIN <= MAX"), ("0:2", "0 < MIN <= MAX"), ("1:", "0 < MIN <= MAX")):
        with pytest.raises(ClusterError, match=message):
            node_range(bad)


def job(min_nodes: int = 2) -> NodeJob:
    return NodeJob(["n1", "n2"], min_nodes, ["--nproc-per-node", "8"], ["--config", "'r.json'", "--run.dir=a b"],
                   ["OMP_NUM_THREADS=4", "NCCL_SOCKET_IFNAME=ib0"], "./launch.sh pretrain --config r.json")


def test_every_node_runs_the_agent_with_its_name_and_the_job_mark() -> None:
    words = job().remote_command()
    line = " ".join(words)
    assert line.startswith("export OMP_NUM_THREADS=4; export NCCL_SOCKET_IFNAME=ib0; cd ")
    assert "-m pretrain.launch.agent --nproc-per-node 8 --job bert-job-" in line and " --node %h " in line
    # what a remote shell makes of it (pdsh puts the host for %h): the arguments as sent
    shown = subprocess.run(["bash", "-c", "printf '%s\\n' " + " ".join(words[2:]).replace("%h", "n2")],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert shown[shown.index("--node") + 1] == "n2"
    assert shown[shown.index("--resume-command") + 1] == "./launch.sh pretrain --config r.json"
    assert shown[-3:] == ["--config", "r.json", "--run.dir=a b"]  # launch/plan.py's quoting, undone once


def test_a_session_that_ends_by_itself_is_no_lost_node() -> None:
    strict = job()
    for status in (0, 1, 2, 3):  # the agent's own ends: done, a fault not healed, config error, NaN
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
