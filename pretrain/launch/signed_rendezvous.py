"""The agents' c10d rendezvous, with every state they write signed by the job's secret and checked before it is read.

torch's dynamic rendezvous keeps its state in one TCP store as a pickle, and unpickles whatever it reads back there,
every monitor tick (0.2 s here) for the whole run. TCPStore has no authentication: whoever reaches its port can
list the keys and write one. Unchecked, a planted pickle would run code in every agent, a forged "closed" state
would end the job and a fake waiting node would restart it again and again. So the agents use SignedBackend in
place of torch's C10dRendezvousBackend (same store, same key, same compare-and-set protocol): each state is stored
as MAGIC, a sequence number, HMAC-SHA256(secret, MAGIC + key + sequence + state) and the state, and a state whose
signature does not verify is never handed to torch, so never unpickled.

What the agents do with a state that fails the check: they keep the last good one and go on (one warning line
naming the store's address, once per agent). Stopping would hand the job to anyone who can write a byte into the
store; going on costs nothing, since the next write of any agent (a heartbeat at least every few seconds) replaces
the foreign value through the ordinary compare-and-set: the fencing token handed back for it is the foreign value
itself. The sequence number makes an old signed state replayed by someone who read it earlier a foreign one too
(a replayed "waiting node" would otherwise restart the ranks).

What it cannot stop: someone who reaches the port can still delete or overwrite the key again and again, or fill
the store, and so stall a rendezvous (the ranks in the middle of an attempt go on; a restart waits); the store
listens only where the nodes reach it (pretrain/launch/rendezvous.py `listen`) to keep that set of people small.

torch names this relies on (besides the public RendezvousParameters and TCPStore): the RendezvousBackend protocol
(name, get_state, set_state with its fencing token: what the handler's state holder reads and writes through, and
the only place it unpickles from) and dynamic_rendezvous.create_handler; tests/launch/test_rendezvous_trust.py
checks them by what they do (a planted pickle never runs, a forged state is never read).

The store: one machine, the agent serves it on a socket bound to the --master-addr it is given (127.0.0.1 by
default; torch's own server would listen on every interface whatever host it is given); several nodes, each agent
is a client of the store nodes.py serves.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)

from pretrain.distributed.cluster import ClusterError
from pretrain.launch import rendezvous_key
from pretrain.launch.rendezvous import endpoint, listen, parse_endpoint
from pretrain.launch.rendezvous_key import RendezvousKeyError

MAGIC = b"BDS1"  # this format's mark: a state written by another toolkit or version is foreign
EMPTY = b"bert-ds-empty"  # the key's value before any state (torch's backend uses a sentinel the same way)
KEY_PREFIX = "torch.rendezvous."  # torch's key, so its tools still find the rendezvous
STORE_TIMEOUT_S = 60  # torch's read_timeout default for the c10d backend
_SEQ_BYTES, _MAC_BYTES = 8, hashlib.sha256().digest_size
_HEADER = len(MAGIC) + _SEQ_BYTES + _MAC_BYTES


class SignedBackend(RendezvousBackend):
    """torch's c10d backend protocol over `store`, each state signed with `secret` (module docstring)."""

    def __init__(self, store: Store, run_id: str, secret: bytes, address: str) -> None:
        self._store, self._key, self._secret, self.address = store, KEY_PREFIX + run_id, secret, address
        self._highest = 0  # the newest sequence number seen: an older one is a replay
        self._last_good: bytes | None = None
        self._empty_token = EMPTY  # what "no state yet" looks like in the store (a foreign value there, once seen)
        self.refused = 0  # foreign values read: told once
        self._call("compare_set", self._key, "", EMPTY)  # a key to read: a get of a missing key would block

    @property
    def name(self) -> str:
        return "c10d"

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._read(self._call("get", self._key))

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        expected = token if isinstance(token, bytes) else self._empty_token
        sealed = self.seal(state, self._highest + 1)
        found = self._call("compare_set", self._key, expected, sealed)
        opened = self._read(found)
        return None if opened is None else (*opened, found == sealed)

    def seal(self, state: bytes, sequence: int) -> bytes:
        """The store's value for `state`: base64 text, as torch's backend stores it."""
        number = sequence.to_bytes(_SEQ_BYTES, "big")
        return base64.b64encode(MAGIC + number + self._mac(number, state) + state)

    def _mac(self, number: bytes, state: bytes) -> bytes:
        return hmac.new(self._secret, MAGIC + self._key.encode() + number + state, hashlib.sha256).digest()

    def _open(self, value: bytes) -> tuple[int, bytes] | str:
        """(sequence, state) of a value this job signed, else what it is (a phrase)."""
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return "a state not signed by this job"
        number, mac, state = raw[len(MAGIC):len(MAGIC) + _SEQ_BYTES], raw[len(MAGIC) + _SEQ_BYTES:_HEADER], raw[_HEADER:]
        if len(raw) < _HEADER or not raw.startswith(MAGIC) or not hmac.compare_digest(mac, self._mac(number, state)):
            return "a state not signed by this job"
        sequence = int.from_bytes(number, "big")
        if sequence < self._highest:
            return "an older state of this job written again"
        return sequence, state

    def _read(self, value: bytes) -> tuple[bytes, Token] | None:
        """torch's view of the store's `value`: its state when signed, else the last good state (or none yet)
        with the foreign value as the token, so that the next write replaces it."""
        if value == EMPTY and self._last_good is None:
            return None
        opened = self._open(value) if value != EMPTY else "no state where a good one was"
        if isinstance(opened, tuple):
            self._highest, self._last_good = opened
            return self._last_good, value
        self._refuse(opened)
        if self._last_good is None:
            self._empty_token = value
            return None
        return self._last_good, value

    def _refuse(self, what: str) -> None:
        self.refused += 1
        if self.refused == 1:
            print(f"launch.sh: warning: the rendezvous store at {self.address} holds {what} (someone who "
                  "reaches that port wrote it): not read; the agents keep the last good state and overwrite it "
                  "(further ones are not told)", file=sys.stderr, flush=True)

    def _call(self, operation: str, *args: object) -> bytes:
        try:
            return getattr(self._store, operation)(*args)
        except (ValueError, RuntimeError, TimeoutError) as err:
            raise RendezvousConnectionError(f"the rendezvous store at {self.address} failed: {err}") from err


@dataclass(frozen=True)
class Meeting:
    """Where and how an agent meets the others: the store's host and port, whether this agent serves it (one
    machine), and the job's secret."""

    host: str
    port: int
    serve: bool
    secret: bytes

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)

    def parameters(self, run_id: str, nodes: tuple[int, int], local_addr: str | None,
                   last_call_s: float) -> RendezvousParameters:
        """torch's settings of the rendezvous `run_id` between nodes[0] and nodes[1] nodes (the handler reads its
        last-call wait from them: run.last_call_seconds)."""
        return RendezvousParameters(backend="c10d", endpoint=self.address, run_id=run_id, min_nodes=nodes[0],
                                    max_nodes=nodes[1], local_addr=local_addr, last_call_timeout=round(last_call_s))


def meeting_for(rdzv_endpoint: str, master: tuple[str, int], key_file: str) -> Meeting:
    """An agent's meeting: with --rdzv-endpoint a client of that store, signing with the key in `key_file`
    (RendezvousKeyError in one line when there is none or it cannot be trusted); else the store served here at
    --master-addr:--master-port, with a key drawn here (the one agent is its only user)."""
    if not rdzv_endpoint:
        return Meeting(master[0], master[1], serve=True, secret=rendezvous_key.draw())
    if not key_file:
        raise RendezvousKeyError("--rdzv-endpoint needs --rdzv-key-file FILE: the job's rendezvous key, which "
                                 "pretrain/launch/nodes.py writes (the agents refuse unsigned rendezvous states)")
    host, port = parse_endpoint(rdzv_endpoint)
    return Meeting(host, port, serve=False, secret=rendezvous_key.read(Path(key_file)))


def open_store(meeting: Meeting) -> TCPStore:
    """The rendezvous store: served here on a socket bound to `meeting.host` alone, or a client of it."""
    timeout = timedelta(seconds=STORE_TIMEOUT_S)
    if not meeting.serve:
        return TCPStore(meeting.host, meeting.port, is_master=False, multi_tenant=True, timeout=timeout)
    sock = listen(meeting.port, meeting.host)  # ClusterError naming the port when it is taken
    # the store owns the descriptor from here on (detach: Python's socket object must not close it under it)
    return TCPStore(meeting.host, meeting.port, is_master=True, multi_tenant=True, wait_for_workers=False,
                    timeout=timeout, master_listen_fd=sock.detach())


def signed_handler(parameters: RendezvousParameters, meeting: Meeting) -> DynamicRendezvousHandler:
    """torch's dynamic rendezvous handler (its timeouts read from `parameters`) over SignedBackend."""
    try:
        store = open_store(meeting)
    except ClusterError:
        raise
    except (ValueError, RuntimeError, TimeoutError) as err:
        raise RendezvousConnectionError(f"the rendezvous store at {meeting.address} cannot be reached: {err}") from err
    return create_handler(store, SignedBackend(store, parameters.run_id, meeting.secret, meeting.address), parameters)
