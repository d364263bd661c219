"""Where the agents of a multi-node job meet: the c10d rendezvous endpoint, and whether this machine serves it.

torch's c10d rendezvous keeps its state in one TCP store. Hosted by the first node's agent (torchrun's default),
that node is a single point of failure: with `--nodes MIN:MAX` the others could not meet again without it. So a
pretrain job on several nodes (a hostfile or a SLURM allocation) keeps the store on the machine that runs
launch.sh, which outlives the nodes: pretrain/launch/nodes.py serves it (pretrain/launch/store.py, a process of its
own) and every agent joins as a client. Under SLURM that machine is the batch script's node, whose death ends the
job anyway (SLURM ends a job whose batch host fails, `--no-kill` or not), and the requeue resumes it.

The endpoint: `--rdzv-endpoint HOST:PORT` (as torchrun spells it), else `--master-addr`:`--master-port`, else this
machine as the nodes reach it (`this_machine`) on the launcher's default port. When HOST is an address of this
machine (`is_this_machine`: can a socket bind it?) launch.sh serves the store there; any other HOST must already
serve one (`python -m pretrain.launch.store --host HOST --port PORT` on a machine that outlives the job), checked
before any node starts (`answers`).

Standard library only: pretrain/launch/plan.py reads it with a bare python3.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence

from pretrain.distributed.cluster import ClusterError

_ENDPOINT = re.compile(r"(?:\[([0-9A-Fa-f:.]+)\]|([^\s:\[\]]+)):([0-9]+)", re.ASCII)


def parse_endpoint(value: str, option: str = "--rdzv-endpoint") -> tuple[str, int]:
    """(host, port) of HOST:PORT (an IPv6 host in brackets); ClusterError in one line naming `option`."""
    found = _ENDPOINT.fullmatch(value)
    if not found or not 0 < int(found[3]) < 65536:
        raise ClusterError(f"{option} must be HOST:PORT with a port number 1-65535 (e.g. login1:29500), got '{value}'")
    return found[1] or found[2], int(found[3])


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_this_machine(host: str) -> bool:
    """Whether `host` names an address of this machine: a socket can bind it (no string compare of names)."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


def this_machine(hosts: Sequence[str]) -> str:
    """The address the nodes reach this machine at: the source address of the route toward the first of `hosts`
    that is not this machine (the interface they share); 127.0.0.1 when every host is this machine (a rehearsal on
    one machine); this machine's name when no host resolves here (a --dry-run away from the cluster)."""
    others = [host for host in hosts if not is_this_machine(host)]
    if not others:
        return "127.0.0.1"
    for host in others:
        try:
            family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(address)  # a datagram socket sends nothing: this only picks the route
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return socket.getfqdn()


def answers(host: str, port: int, timeout_s: float = 10.0) -> str | None:
    """None when something accepts connections at host:port, else why not (one phrase)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as err:
        return err.strerror or str(err)


def listen(port: int, host: str = "127.0.0.1") -> socket.socket:
    """A socket listening at `host`:`port` alone, for the store to take over (its descriptor is handed to torch's
    TCPStore, pretrain/launch/store.py and signed_rendezvous.py): bound before any node starts, so a port already
    taken is one line, not a rendezvous with somebody else's store. Bound to the address the nodes reach this machine
    at (loopback on one machine), never to every interface: torch's own server would listen on all of them (`[::]`),
    whatever host it is given. ClusterError naming the port when it cannot be bound."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise ClusterError(f"the rendezvous host '{host}' does not resolve ({err.strerror or err})") from err
    problem: OSError | None = None
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(1024)
            return sock
        except OSError as err:
            sock.close()
            problem = problem or err
    why = problem.strerror or problem if problem else "no address"
    raise ClusterError(f"the rendezvous port {port} of this machine cannot be used at {host} ({why}); "
                       "pass a free one with --master-port or --rdzv-endpoint HOST:PORT")
