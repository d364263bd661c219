"""The rendezvous store is reachable by others; what they write there runs nothing and forges nothing.

A store served as our agents serve it on one machine (pretrain/launch/signed_rendezvous.py: the agent's own store,
torch's dynamic rendezvous handler over SignedBackend), then an intruder who can reach the port: a pickle whose
`__reduce__` writes a marker file, set into the rendezvous key that `list_keys()` names, is never unpickled by the
handler's next sync (one line names the store's address); a forged "closed" state (a plain pickle of torch's own
state, no payload) does not close the job, and the next rendezvous overwrites it; an old signed state written again
is refused by an agent that has seen a newer one. The store's socket listens on loopback alone, and the key file the
nodes read is the user's alone. In process, a store and a handler each: seconds.
"""

from __future__ import annotations

import base64
import os
import pickle
import socket
import stat
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, _RendezvousState

from pretrain.launch import rendezvous_key
from pretrain.launch.nodes import NodeJob, serve_store
from pretrain.launch.rendezvous import listen
from pretrain.launch.rendezvous_key import RendezvousKeyError
from pretrain.launch.signed_rendezvous import KEY_PREFIX, Meeting, SignedBackend, meeting_for, signed_handler
from pretrain.launch.transports import Pdsh
from tests.support.launching import free_port
from tests.support.listening import listening
from tests.support.rendezvous_intruder import Planted


def served_handler(run_id: str) -> tuple[DynamicRendezvousHandler, Meeting]:
    """A handler as the agent of a one-machine launch builds it (pretrain/launch/agent.py build_agent)."""
    meeting = meeting_for("", ("127.0.0.1", free_port()), "")
    return signed_handler(meeting.parameters(run_id, (1, 1), "127.0.0.1", 3.0), meeting), meeting


def intruder(meeting: Meeting) -> tuple[TCPStore, str]:
    """A client of the store, as anybody who reaches its port is, and the rendezvous key it lists."""
    store = TCPStore(meeting.host, meeting.port, is_master=False, timeout=timedelta(seconds=10))
    return store, next(key for key in store.list_keys() if key.startswith(KEY_PREFIX) and key.count(".") == 2)


def test_a_pickle_planted_in_the_rendezvous_store_is_never_unpickled(tmp_path: Path,
                                                                      capfd: pytest.CaptureFixture) -> None:
    handler, meeting = served_handler("bert-planted")
    store, key = intruder(meeting)
    marker = tmp_path / "marker"
    store.set(key, base64.b64encode(pickle.dumps(Planted(marker))))
    assert handler.num_nodes_waiting() == 0  # torch's agent asks this at every monitor tick: a sync
    assert not handler.is_closed()
    assert not marker.exists()
    lines = [line for line in capfd.readouterr().err.splitlines() if "rendezvous store" in line]
    assert len(lines) == 1 and f"the rendezvous store at {meeting.address} holds a state not" in lines[0]


def test_a_forged_closed_state_does_not_end_the_job_and_the_next_rendezvous_overwrites_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the agent sets it: no second store here
    handler, meeting = served_handler("bert-forged")
    assert handler.next_rendezvous().world_size == 1  # a signed state with this node in it: round 1
    store, key = intruder(meeting)
    forged = _RendezvousState()
    forged.round, forged.closed = 7, True
    store.set(key, base64.b64encode(pickle.dumps(forged)))
    assert not handler.is_closed()  # unsigned: not read; the last good state stands
    assert handler.next_rendezvous().world_size == 1  # a restart still meets, and its write replaces the forgery
    reader = SignedBackend(store, "bert-forged", meeting.secret, meeting.address)
    state_bits, _ = reader.get_state() or (b"", b"")
    assert reader.refused == 0
    state = pickle.loads(state_bits)  # signed by the job: trusted
    assert state.round < forged.round and not state.closed and len(state.participants) == 1  # ours, not the forgery


def test_an_older_signed_state_written_again_is_refused_by_an_agent_that_saw_a_newer_one() -> None:
    """A replay: someone who read the store earlier (a state with a node waiting, say) writes it back later."""
    meeting = meeting_for("", ("127.0.0.1", free_port()), "")
    served = signed_handler(meeting.parameters("bert-replay", (1, 1), "127.0.0.1", 3.0), meeting)  # its store
    store, key = intruder(meeting)
    first, second = (SignedBackend(store, "bert-replay", meeting.secret, meeting.address) for _ in range(2))
    written = first.set_state(b"round 1")
    assert written is not None and written[2]
    old = store.get(key)
    assert first.set_state(b"round 2", written[1]) is not None
    assert second.get_state() is not None  # it saw round 2
    store.set(key, old)
    state, token = second.get_state() or (b"", b"")
    assert (state, token, second.refused) == (b"round 2", old, 1)  # the last good state; the replay is the token
    rewritten = second.set_state(b"round 3", token)  # so the next write replaces it
    assert rewritten is not None and rewritten[2] and first.get_state() is not None and first.refused == 0
    assert served.get_run_id() == "bert-replay"  # the server lived to here


def test_the_store_of_one_machine_listens_on_loopback_alone() -> None:
    """torch's server, given 127.0.0.1, would listen on [::] (every interface, IPv4 too)."""
    _, meeting = served_handler("bert-bound")
    assert listening(meeting.port) == ["0100007F"]  # 127.0.0.1 alone
    with listen(0, "127.0.0.1") as sock:  # the multi-node store's socket (nodes.py, store.py): where it is told
        assert sock.getsockname()[0] == "127.0.0.1" and listening(sock.getsockname()[1]) == ["0100007F"]
    with socket.socket() as probe, pytest.raises(OSError):  # nothing answers on another address of the machine
        probe.settimeout(5)
        probe.connect(("127.0.0.2", meeting.port))


def test_the_store_nodes_py_serves_listens_on_the_endpoints_address_alone_and_answers_there() -> None:
    """A multi-node job's store (pretrain/launch/store.py, on the socket nodes.py bound): at an address of this
    machine other than 127.0.0.1, as a cluster interface would be; its own client must dial that address too."""
    port = free_port()
    job = NodeJob(["node1", "node2"], 2, Pdsh("bert-job-store"), [], [], "again", f"127.0.0.2:{port}")
    served = serve_store(job)
    assert served is not None
    try:
        client = TCPStore("127.0.0.2", port, is_master=False, timeout=timedelta(seconds=60))
        client.set("probe", "1")
        assert client.get("probe") == b"1" and served.poll() is None
        assert listening(port) == ["0200007F"]  # 127.0.0.2 alone, not every interface
    finally:
        served.terminate()
        served.wait()


def test_the_key_file_is_the_users_alone_and_anything_else_is_refused_in_one_line(tmp_path: Path) -> None:
    path, secret = rendezvous_key.write(tmp_path)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert rendezvous_key.read(path) == secret
    assert meeting_for("127.0.0.1:1", ("127.0.0.1", 1), str(path)).secret == secret
    path.chmod(0o640)
    with pytest.raises(RendezvousKeyError, match=f"the rendezvous key file {path} is not a file of this user's"):
        rendezvous_key.read(path)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(RendezvousKeyError, match=f"the rendezvous key file {link} cannot be read"):
        rendezvous_key.read(link)
    with pytest.raises(RendezvousKeyError, match="--rdzv-endpoint needs --rdzv-key-file"):
        meeting_for("127.0.0.1:1", ("127.0.0.1", 1), "")
    path.chmod(0o600)
    rendezvous_key.remove(path)
    assert not path.parent.exists() and os.listdir(tmp_path) == ["link"]
