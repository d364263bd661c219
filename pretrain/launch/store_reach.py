"""Before any agent starts: which nodes reach the rendezvous store, asked of every node at once.

A node that cannot reach the store would leave every agent waiting out torch's join timeout (600 s) before a line
says anything; asked first, it is one line. Every node is asked, in parallel (one pdsh session each, with its own
time limit), so a node that is down costs one limit, not one per node, and no node is the check's single point of
failure: the job starts when at least MIN of them reach the store (`--nodes MIN:MAX`), without the others, named in
one line; it is refused, naming them, only when fewer than MIN do. And the store itself, served on this machine
for pretrain/launch/nodes.py (serve_store). Standard library only.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from pretrain.distributed.cluster import ClusterError
from pretrain.launch.rendezvous import answers, is_this_machine, listen, parse_endpoint

MAX_ASKED_AT_ONCE = 64  # pdsh sessions open together (each a short ssh + python -c)

Asker = Callable[[str, tuple[str, int]], "str | None"]  # (node, (host, port)) -> its problem, None when it reaches


def unreached(hosts: Sequence[str], store: tuple[str, int], ask: Asker) -> dict[str, str]:
    """Node -> what it said, for every node of `hosts` that cannot reach `store` (asked in parallel)."""
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_ASKED_AT_ONCE, len(hosts)))) as pool:
        problems = list(pool.map(lambda node: ask(node, store), hosts))
    return {node: problem for node, problem in zip(hosts, problems, strict=True) if problem}


def before_start(hosts: Sequence[str], min_nodes: int, endpoint: str, ask: Asker,
                 serving: bool) -> tuple[list[str], list[str]]:
    """The nodes to start and the warnings to show before any agent starts: the nodes left out (reaching), and, with
    --nodes MIN:MAX, when this machine is both a node and the store's host, that it is the one node the job cannot
    lose. ClusterError when fewer than `min_nodes` reach the store."""
    left, left_out = reaching(hosts, min_nodes, endpoint, parse_endpoint(endpoint), ask)
    warnings = [left_out] if left_out else []
    here = [node for node in left if is_this_machine(node)]
    if serving and here and min_nodes < len(left):
        warnings.append(f"warning: this machine ({here[0]}) is a node of the job and serves its rendezvous store: "
                        "losing it ends the job, --nodes MIN:MAX or not. Launch from a machine outside the hostfile "
                        "(under tmux or nohup), or serve the store there (python -m pretrain.launch.store --host HOST "
                        "--port P), pass --rdzv-endpoint HOST:P")
    return left, warnings


def reaching(hosts: Sequence[str], min_nodes: int, endpoint: str, store: tuple[str, int],
             ask: Asker) -> tuple[list[str], str | None]:
    """The nodes to start (those that reach the store) and the warning naming the others (None: every node does).
    ClusterError, naming the others, when fewer than `min_nodes` reach it."""
    missing = unreached(hosts, store, ask)
    if not missing:
        return list(hosts), None
    left = [node for node in hosts if node not in missing]
    named = "; ".join(f"{node} ({problem})" for node, problem in missing.items())
    if len(left) < min_nodes:
        raise ClusterError(f"{len(missing)} of {len(hosts)} node(s) cannot reach the rendezvous store at {endpoint}: "
                           f"{named}; {len(left)} can, the job needs {min_nodes}. A machine down or unreachable over "
                           "ssh, a firewall between the nodes and this machine, or a name they resolve elsewhere? "
                           "--rdzv-endpoint HOST:PORT names an address they reach")
    return left, (f"warning: node(s) left out, they cannot reach the rendezvous store at {endpoint}: {named}; "
                  f"starting on the {len(left)} that can (--nodes {min_nodes}:{len(hosts)})")


class Endpoint(Protocol):
    """A job's rendezvous endpoint, HOST:PORT (pretrain/launch/nodes.py NodeJob)."""

    rendezvous: str


def serve_store(job: Endpoint) -> subprocess.Popen[bytes] | None:
    """The rendezvous store on this machine (pretrain/launch/store.py) when the endpoint is here, on the socket bound
    now (a port already taken is one line before any node starts); else check that the store elsewhere answers."""
    host, port = parse_endpoint(job.rendezvous)
    if not is_this_machine(host):
        problem = answers(host, port)
        if problem:
            raise ClusterError(f"--rdzv-endpoint {job.rendezvous}: no rendezvous store answers there ({problem}); "
                               f"serve one there (python -m pretrain.launch.store --host {host} --port {port}) or leave "
                               "--rdzv-endpoint out (launch.sh then serves it on this machine)")
        return None
    sock = listen(port, host)  # where the nodes reach this machine, not every interface
    try:
        command = [sys.executable, "-u", "-m", "pretrain.launch.store", "--host", host, "--port", str(port),
                   "--listen-fd", str(sock.fileno()), "--with-parent"]  # --host: its own client dials the socket
        return subprocess.Popen(command, pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    finally:
        sock.close()  # the store holds it now


class Checked(Endpoint, Protocol):
    """A job as check_before_start reads it (pretrain/launch/nodes.py NodeJob)."""

    hosts: list[str]
    min_nodes: int

    @property
    def transport(self) -> Any: ...


def check_before_start(job: Checked, serving: bool, say: Callable[[str], None]) -> list[str]:
    """What can be said before any agent starts (before_start: the nodes that reach the store, this machine serving
    it as a node), each line through `say`; the hosts that reach it. ClusterError when too few do."""
    hosts, warnings = before_start(job.hosts, job.min_nodes, job.rendezvous, job.transport.store_problem, serving)
    for line in warnings:
        say(line)
    return hosts
