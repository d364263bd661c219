"""A node whose agent never joins the rendezvous (pretrain/launch/joins.py): named after the others' wait, and stopped
without --nodes MIN:MAX, or named as left behind by a round under it; the agents' notes read by the real relay of
pretrain/launch/nodes.py. No launch: an agent stuck before it joins is a process that prints nothing."""

from __future__ import annotations

import io
import signal
import threading

import pytest

from pretrain.launch.fault_records import FaultLines
from pretrain.launch.joins import NOT_JOINED_S, JoinNote, JoinWatch, watch_joins
from pretrain.launch.nodes import NodeJob, relay
from pretrain.launch.transports import Pdsh


class NotedPdsh(Pdsh):
    """Pdsh whose signals and drops are noted, not run over pdsh."""

    def __init__(self) -> None:
        super().__init__("bert-job-1")
        self.dropped: list[str] = []
        self.signalled: list[tuple[int, list[str]]] = []

    def drop(self, host: str) -> bool:
        self.dropped.append(host)
        return True

    def signal(self, signum: int, hosts: list[str]) -> None:  # type: ignore[override]
        self.signalled.append((signum, list(hosts)))


def notes(*pairs: tuple[str, int]) -> io.StringIO:
    return io.StringIO("".join(f"{host}: {JoinNote(host, nodes, 3.0).to_line()}\n" for host, nodes in pairs))


def test_a_node_silent_while_the_others_wait_is_named_and_the_job_stops(capsys: pytest.CaptureFixture) -> None:
    transport = NotedPdsh()
    job = NodeJob(["n1", "n2", "n3"], 3, transport, [], [], "./launch.sh pretrain again")
    out = io.StringIO()
    relay(notes(("n1", 0), ("n3", 0)), out, job, FaultLines(out, lambda: 3))
    assert out.getvalue() == ""  # the notes are the agents' word to nodes.py, not the terminal's
    waited = min(job.joins.waiting.values())
    assert job.joins.silent(job.hosts, waited + NOT_JOINED_S - 1) == []  # not yet
    assert job.joins.silent(job.hosts, waited + NOT_JOINED_S) == ["n2"]
    told: list[tuple[list[str], int]] = []
    watch_joins(job.joins, lambda: job.hosts, True, lambda hosts, nodes: told.append((hosts, nodes)),
                threading.Event(), clock=lambda: waited + NOT_JOINED_S, tick_s=0.01)
    assert told == [(["n2"], 0)]
    job.not_joined(["n2"], 0)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"launch.sh: error: node(s) n2 have not joined the rendezvous {NOT_JOINED_S:g} s after the others "
                    "began to wait (an agent stuck before it joins: a stale mount, a cold file system); stopping every "
                    "node; resume with: ./launch.sh pretrain again")
    assert job.failed and transport.signalled == [(signal.SIGTERM, ["n1", "n3"])]
    threading.Event().wait(0.2)  # the silent node's agent is ended from a thread
    assert transport.dropped == ["n2"]


def test_under_nodes_min_max_a_round_that_leaves_a_node_behind_names_it(capsys: pytest.CaptureFixture) -> None:
    joins = JoinWatch()
    for host in ("n1", "n3"):
        joins.note(JoinNote(host, 0, 3.0), 10.0)
    for host in ("n1", "n3"):
        joins.note(JoinNote(host, 2, 3.0), 14.0)  # the last call ended: a round of 2
    assert joins.silent(["n1", "n2", "n3"], 500.0) == []  # nobody waits any more
    assert joins.left_behind(["n1", "n2", "n3"], 15.0) == ([], 0)  # not settled yet
    assert joins.left_behind(["n1", "n2", "n3"], 16.5) == (["n2"], 2)
    assert joins.left_behind(["n1", "n2", "n3"], 17.0) == ([], 0)  # each round once
    job = NodeJob(["n1", "n2", "n3"], 2, NotedPdsh(), [], [])
    job.not_joined(["n2"], 2)
    assert capsys.readouterr().err == ("launch.sh: warning: node(s) n2 had not joined the rendezvous when its last call "
                                       "ended: the job goes on with 2 node(s) (--nodes 2:3); they join at its next "
                                       "round\n")
    assert not job.failed and not job.stopping
    # every node in the round: nothing to say; a later round with the node back: nothing either
    for host in ("n1", "n2", "n3"):
        joins.note(JoinNote(host, 3, 3.0), 40.0)
    assert joins.left_behind(["n1", "n2", "n3"], 45.0) == ([], 0)
