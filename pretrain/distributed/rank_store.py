"""The ranks' own store (the TCP store each attempt's process group meets in), listening only where the ranks
reach it.

torch.distributed's `env://` rendezvous has rank 0 start a TCPStore server on MASTER_PORT, and torch's server
listens on every interface (`[::]`, IPv4 included) whatever MASTER_ADDR says: a one-machine job's store, asked for
127.0.0.1, answered every machine that reached the port. The store has no authentication, and it holds what the
ranks dial each other at. So rank 0 binds the listening socket itself, to the address MASTER_ADDR has on its own
machine (loopback for a job on one machine, the cluster address the launcher gave otherwise), and hands it to
torch's server (`master_listen_fd`); the other ranks are clients, as with `env://`. The process group is built on
that store (`init_process_group(store=...)`, pretrain/distributed/process_group.py).

Where torch's own server is kept, and why:
- the ranks of a torchrun that shares its agent's store (TORCHELASTIC_USE_AGENT_STORE=True, torchrun's default):
  the store is the agent's, already serving; the ranks are its clients (`None` here: torch's `env://`). Our agent
  (pretrain/launch/agent.py) gives each attempt's ranks a store of their own, so it is ours there.
- MASTER_ADDR names no address of this machine (a forwarded or virtual address), or a name that resolves here to
  loopback while ranks run on other machines (some /etc/hosts files map the machine's own name to 127.0.1.1):
  bound there, the other machines could not reach it. One line says so, and torch's server listens on every
  interface, as before.

Standard library and torch only; nothing here reads the run config.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistNetworkError, Store, TCPStore

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True)
class RankStoreSettings:
    """What the ranks' store is built from: the rendezvous variables of this rank, and how long to wait."""

    host: str
    port: int
    rank: int
    world_size: int
    local_world_size: int | None  # ranks on this machine, when the launcher says (None: not known)
    timeout: timedelta
    agent_store: bool  # the launcher's agent already serves the store (torchrun's shared store)

    @classmethod
    def from_env(cls, env: Mapping[str, str], timeout: timedelta) -> RankStoreSettings:
        """From RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (filled by process_group._fill_rendezvous_env), and
        LOCAL_WORLD_SIZE (torch's elastic agent, our SLURM mapping) or LOCAL_SIZE (DeepSpeed's launcher)."""
        local = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
        return cls(host=env["MASTER_ADDR"], port=int(env["MASTER_PORT"]), rank=int(env["RANK"]),
                   world_size=int(env["WORLD_SIZE"]), local_world_size=int(local) if local else None,
                   timeout=timeout, agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True))

    @property
    def one_machine(self) -> bool:
        """Every rank runs on this machine: the launcher says so, or MASTER_ADDR is loopback for every rank."""
        return self.local_world_size == self.world_size or loopback_everywhere(self.host)


def loopback_everywhere(host: str) -> bool:
    """`host` is a loopback address or name on every machine (not a name some machine maps to 127.0.1.1)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_here(host: str, port: int) -> socket.socket | None:
    """A socket listening at `port` on the first address `host` resolves to that this machine has; None when it
    has none of them. DistNetworkError naming host and port when the port is taken there."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's server: a port in TIME_WAIT is free
        try:
            sock.bind(address)
        except OSError as err:
            sock.close()
            if err.errno == errno.EADDRINUSE:  # this machine's address, somebody else's port
                raise DistNetworkError(f"the ranks' store cannot listen at {host}:{port} ({address[0]}): "
                                       f"EADDRINUSE, address already in use") from err
            continue  # EADDRNOTAVAIL: not an address of this machine
        sock.listen(1024)
        return sock
    return None


def _say(line: str) -> None:
    print(f"process_group: {line}", file=sys.stderr, flush=True)


def rank_store(settings: RankStoreSettings) -> Store | None:
    """This rank's store for the default process group: rank 0 serves it on its own socket, the others are clients.
    None where torch's `env://` is kept (module docstring): the agent's shared store."""
    if settings.agent_store:
        return None
    if settings.rank != 0:
        return TCPStore(settings.host, settings.port, world_size=settings.world_size, is_master=False,
                        timeout=settings.timeout)
    sock = bind_here(settings.host, settings.port)
    why = f"MASTER_ADDR {settings.host} names no address of this machine"
    if sock is not None and ipaddress.ip_address(sock.getsockname()[0]).is_loopback and not settings.one_machine:
        sock.close()
        sock = None
        why = f"MASTER_ADDR {settings.host} is a loopback address on this machine, and ranks run on other machines"
    if sock is None:
        _say(f"warning: {why}: the ranks' store listens on every interface (torch's own server); give the address "
             f"the other machines reach this one at")
        return TCPStore(settings.host, settings.port, world_size=settings.world_size, is_master=True,
                        timeout=settings.timeout, multi_tenant=True)
    # the store owns the descriptor from here on (detach: Python's socket object must not close it under it);
    # multi_tenant as env:// makes it: another store for this port in this process shares the server
    return TCPStore(settings.host, settings.port, world_size=settings.world_size, is_master=True,
                    timeout=settings.timeout, multi_tenant=True, master_listen_fd=sock.detach())


def rank_store_from_env(timeout: timedelta) -> Store | None:
    """rank_store for this process's rendezvous variables."""
    return rank_store(RankStoreSettings.from_env(os.environ, timeout))
