"""The ranks' own store listens on loopback alone for a job on one machine, and the ranks exchange values as JSON.

Two real rank processes with the variables our elastic agent gives a one-machine job's ranks (MASTER_ADDR
127.0.0.1, a store of their own: TORCHELASTIC_USE_AGENT_STORE=False), joined by the driver's init_distributed over
gloo (tests/scripts/rank_store_ranks.py). torch's own server, asked for 127.0.0.1, listens on every interface
(`[::]`, IPv4 included); ours is bound to 127.0.0.1 (pretrain/distributed/rank_store.py). Over the same group:
pretrain/distributed/json_collectives.py, which replaced torch's pickling `*_object` collectives, and SQuAD's
logits and the plan's self-test verdicts gathered through it (pretrain/finetune/squad/inference.py gather_rows,
pretrain/device_check/settle.py gather), a save's failures and the resume votes (pretrain/checkpointing/).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from torch.distributed import TCPStore

from pretrain.device_check.verdict import SelfTestResult
from pretrain.distributed.rank_store import RankStoreSettings, bind_here, loopback_everywhere, rank_store
from tests.scripts.rank_store_ranks import listening
from tests.support.launching import deepspeed_cpu_env, free_port
from tests.support.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "tests" / "scripts" / "rank_store_ranks.py"


def results_of_two_ranks(work: Path) -> dict[int, dict]:
    (work / "fresh").mkdir()
    (work / "refused").mkdir()
    (work / "refused" / "latest").write_text("../elsewhere")
    port = free_port()
    env = deepspeed_cpu_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                                 "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    ranks = [subprocess.Popen([sys.executable, "-u", str(SCRIPT), str(work)], cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in (0, 1)]
    results = {}
    for rank, proc in enumerate(ranks):
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            for each in ranks:
                if each.poll() is None and proc.returncode is None:
                    each.kill()
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err[-4000:]}"
        line = next(line for line in out.splitlines() if line.startswith("RESULT "))
        results[rank] = json.loads(line.removeprefix("RESULT "))
    return results


@pytest.mark.multirank
def test_the_ranks_store_listens_on_loopback_alone_and_values_cross_as_json(tmp_path: Path) -> None:
    results = results_of_two_ranks(tmp_path)
    assert results[0]["listening"] == ["0100007F"]  # 127.0.0.1 alone: not [::] (torch's server), not 0.0.0.0
    for rank in (0, 1):
        got = results[rank]
        assert got["world_size"] == 2
        assert [each["rank"] for each in got["gathered"]] == [0, 1]
        assert got["gathered"][1]["pair"] == ["tag", 1]  # a tuple arrives as a list
        assert got["gathered"][1]["text"] == "é" and got["gathered"][0]["text"] == ""
        assert got["gathered"][0]["nan"] != got["gathered"][0]["nan"]  # NaN passes (json.loads("NaN"))
        assert got["broadcast"] == ["from rank 1", {"k": [1, 2.5]}]
        assert got["empty"] == ["", "0001"]
        assert got["floats_exact"] is True
        assert "not JSON serializable" in got["refused"]
        assert got["after_refusal"] == [0, 1]
        want = [[10 * r + i, [float(np.float32(r + i / 7))] * (i + 1),
                 (-np.arange(i + 1, dtype=np.float32) / 3).tolist()] for r in (0, 1) for i in range(r + 1)]
        sent = repr(asdict(SelfTestResult(False, "cpu fp32", 2e-3, 1e-5, kernel_part="dq")))  # NaN fields too
        assert got["verdicts"] == [["host0", [True, True], None, None],
                                   ["host1", [True, False], ["SelfTestResult", sent], None]]
        assert got["squad_rows"] == want
        assert got["failures"] == ["rank 1: disk full"]  # a save's failures, world-wide
        assert got["fresh"] is None  # resume votes: ["fresh", ""] and ["abstain", ""], read as the pairs
        assert "latest" in got["refused_resume"] and "elsewhere" in got["refused_resume"]  # SQuAD's logits gathered bit for bit, window lengths kept


def test_which_addresses_count_as_one_machine() -> None:
    """A loopback address or `localhost` is this machine for every rank; a name is not (some /etc/hosts files map
    a machine's own name to 127.0.1.1, which the other nodes resolve to its cluster address)."""
    assert loopback_everywhere("127.0.0.1") and loopback_everywhere("::1") and loopback_everywhere("localhost")
    assert not loopback_everywhere("node1") and not loopback_everywhere("10.0.0.5")
    settings = RankStoreSettings("node1", 1, 0, 16, 8, timeout=None, agent_store=False)  # type: ignore[arg-type]
    assert not settings.one_machine
    assert RankStoreSettings("127.0.0.1", 1, 0, 16, None, None, False).one_machine  # type: ignore[arg-type]


def test_an_address_of_another_machine_is_not_bound_and_a_taken_port_is_named() -> None:
    assert bind_here("192.0.2.1", free_port()) is None  # TEST-NET-1: never an address of this machine
    with bind_here("127.0.0.1", 0) as held:
        assert held is not None
        with pytest.raises(Exception, match=r"cannot listen at 127.0.0.1:\d+ .*EADDRINUSE"):
            bind_here("127.0.0.1", held.getsockname()[1])


def test_a_name_that_is_loopback_here_in_a_world_of_several_machines_keeps_torchs_server_with_one_line(
        capfd: pytest.CaptureFixture) -> None:
    """Some /etc/hosts files map the machine's own name to a loopback address (127.0.1.1), while the other nodes
    resolve it to its cluster address: bound to loopback, they could not reach the store. Rank 0 of a world on two
    machines keeps torch's server (every interface) and says so; a client of the store still meets it."""
    host = socket.gethostname()
    try:
        here = ipaddress.ip_address(socket.gethostbyname(host))
    except OSError:
        pytest.skip(f"this machine's name {host} does not resolve")
    if not here.is_loopback:
        pytest.skip(f"this machine's name {host} resolves to {here}, not to a loopback address")
    port, timeout = free_port(), timedelta(seconds=60)
    clients: list[TCPStore] = []
    peer = threading.Thread(target=lambda: clients.append(TCPStore(host, port, 2, is_master=False, timeout=timeout)))
    peer.start()
    store = rank_store(RankStoreSettings(host, port, rank=0, world_size=2, local_world_size=1, timeout=timeout,
                                         agent_store=False))
    peer.join()
    assert store is not None
    store.set("met", "yes")
    assert clients[0].get("met") == b"yes"
    assert listening(port) == ["0" * 32]  # [::]: every interface, IPv4 included
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("process_group:")]
    assert lines == [f"process_group: warning: MASTER_ADDR {host} is a loopback address on this machine, and ranks "
                     "run on other machines: the ranks' store listens on every interface (torch's own server); give "
                     "the address the other machines reach this one at"]
