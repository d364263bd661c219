"""The parts of torch's elastic agent our agent relies on that are not torch's public API, checked in seconds and
without ranks: names, signatures, and the lines of torch's run loop the agent's behaviour depends on.

pretrain/launch/agent.py's docstring lists them (items 1-9); the public API it uses is checked here too, where a
change would fail only at the first fault. A failure says what changed and what depends on it: read torch's new
code, adapt the agent, and raise the upper bound on torch in pyproject.toml only once this file passes on the new
version. It has passed on torch 2.13.0 and 2.14.1 (the bound is <2.15); the checks of items 7-9 and the planted
changes (each guarded name taken away from a copy of torch's code: the guard's own line, not a bare error) were
added later and have run on 2.13.0 only. It imports nothing of the project but
pretrain/launch/hang_watch.py (torch and the standard library), so it also runs in a bare environment with the
next torch: `PYTHONPATH=. python -m pytest --noconftest tests/launch/test_torch_internals.py`.
"""

from __future__ import annotations

import inspect
import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, Worker, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, ProcessFailure, SignalException
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    c10d_rendezvous_backend,
    dynamic_rendezvous,
)
from torch.distributed.elastic.timer import FileTimerClient, FileTimerRequest, FileTimerServer

TORCH = torch.__version__


def source(function: Callable[..., object]) -> str:
    return inspect.getsource(function)


def parameters(function: Callable[..., object]) -> list[str]:
    return list(inspect.signature(function).parameters)


def changed(what: str, why: str) -> str:
    return f"torch {TORCH} changed {what}: {why} (pretrain/launch/agent.py's docstring lists what relies on it)"


def need(found: bool, what: str, why: str) -> None:
    """The guard's one-line failure (a plain raise: pytest's assertion rewriting would add lines to it)."""
    if not found:
        raise AssertionError(changed(what, why))


def member(owner: object, name: str) -> Callable[..., object]:
    """`owner.name`, or the guard's line when torch renamed or removed it (not a bare AttributeError)."""
    label = f"{getattr(owner, '__name__', owner)}.{name}"
    need(hasattr(owner, name), label, "it is gone")
    return getattr(owner, name)


def source_of(owner: object, name: str) -> str:
    return source(member(owner, name))


def test_the_run_loop_restarts_on_remaining_restarts_and_on_nodes_waiting() -> None:
    """Items 1 and 3: `_invoke_run` restarts a failed group while `_remaining_restarts` > 0 (a final verdict sets it to
    0) and restarts a healthy one, uncounted, when `num_nodes_waiting()` > 0 (the agent counts that restart)."""
    loop = source_of(SimpleElasticAgent, "_invoke_run")
    for needed in ("self._remaining_restarts > 0", "self._remaining_restarts -= 1", "num_nodes_waiting()",
                   "self._restart_workers(", "self._monitor_workers(", "WorkerState.HEALTHY"):
        assert needed in loop, changed("SimpleElasticAgent._invoke_run", f"it no longer contains `{needed}`")
    assert "self._remaining_restarts = " in source_of(SimpleElasticAgent, "__init__"), changed(
        "SimpleElasticAgent.__init__", "it no longer keeps `_remaining_restarts`")


@pytest.mark.parametrize("name", ["_monitor_workers", "_restart_workers"])
def test_the_overridden_hooks_exist_with_their_signature(name: str) -> None:
    """Item 2 (torch's documented hook for extending the agent) and item 3: overridden by HealingAgent."""
    assert hasattr(LocalElasticAgent, name), changed(f"LocalElasticAgent.{name}", "it is gone")
    assert parameters(getattr(LocalElasticAgent, name)) == ["self", "worker_group"], changed(
        f"LocalElasticAgent.{name}", f"its parameters are now {parameters(getattr(LocalElasticAgent, name))}")


def test_the_timer_server_reaps_through_a_hook_and_then_itself() -> None:
    """Item 4: FileTimerServer calls `_reap_worker(pid, signal)` for each expired worker, then with its own pid (our
    override skips that one), and hands every request it reads to `register_timers`."""
    watchdog = source_of(FileTimerServer, "_run_watchdog")
    for needed in ("self._reap_worker(worker_pid, signal)", "self._reap_worker(os.getpid()", "self.register_timers("):
        assert needed in watchdog, changed("FileTimerServer._run_watchdog", f"it no longer contains `{needed}`")
    assert parameters(FileTimerServer._reap_worker) == ["self", "worker_pid", "signal"], changed(
        "FileTimerServer._reap_worker", f"its parameters are now {parameters(FileTimerServer._reap_worker)}")
    assert parameters(FileTimerServer.register_timers) == ["self", "timer_requests"], changed(
        "FileTimerServer.register_timers", "its parameters changed")
    assert parameters(FileTimerServer.__init__)[:5] == ["self", "file_path", "run_id", "max_interval", "daemon"]
    request = FileTimerRequest(7, "start-up", 1.5, 9)  # the agent arms start-up through the pipe in this form
    assert (request.worker_pid, request.scope_id, request.expiration_time, request.signal) == (7, "start-up", 1.5, 9)
    assert '"pid": 7' in request.to_json() and '"scope_id": "start-up"' in request.to_json()
    assert {"acquire", "release"} <= set(dir(FileTimerClient)) and parameters(FileTimerClient.acquire) == [
        "self", "scope_id", "expiration_time"]


def check_the_watchdog_hand_over() -> None:
    """Item 5: with TORCHELASTIC_ENABLE_FILE_TIMER unset and TORCHELASTIC_TIMER_FILE set, `_setup_local_watchdog`
    starts no FileTimerServer (torch's would kill the agent at the first hang) and passes the path to the ranks."""
    what = "LocalElasticAgent._setup_local_watchdog"
    watchdog = source_of(LocalElasticAgent, "_setup_local_watchdog")
    for needed in ("TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE", '== "1"'):
        need(needed in watchdog, what, f"no `{needed}` in it")
    need('os.getenv(watchdog_file_env_name)' in watchdog and "worker_env[watchdog_file_env_name]" in watchdog,
         what, "it no longer hands TORCHELASTIC_TIMER_FILE to the ranks")
    need("self._setup_local_watchdog(" in source_of(LocalElasticAgent, "_start_workers"),
         "LocalElasticAgent._start_workers", "no watchdog set-up")


def check_the_signals_stay_the_agents() -> None:
    """Item 7: agent.py sets TORCHELASTIC_SIGNALS_TO_HANDLE=SIGQUIT, so torch's `PContext.start` (every attempt)
    installs its own handler for SIGQUIT alone. Read under another name, torch would put its SIGTERM/SIGINT/SIGHUP
    handlers over HealingAgent.forward: a Ctrl-C would become torch's shutdown instead of the ranks' checkpoint."""
    need('"TORCHELASTIC_SIGNALS_TO_HANDLE"' in source_of(PContext, "start"), "PContext.start",
         "it no longer reads TORCHELASTIC_SIGNALS_TO_HANDLE (torch's handlers would replace the agent's forwarding)")


def check_the_ranks_get_the_run_id() -> None:
    """Item 8: pretrain/distributed/info.py reads TORCHELASTIC_RUN_ID (with TORCHELASTIC_RESTART_COUNT) to tell a
    restart under our agent; without it every restart reads as a first launch (goodput counts no gap after a fault,
    and every restart hashes the shards again), silently."""
    need('"TORCHELASTIC_RUN_ID"' in source_of(LocalElasticAgent, "_start_workers"),
         "LocalElasticAgent._start_workers", "it no longer sets TORCHELASTIC_RUN_ID for the ranks")


def check_the_last_call_key() -> None:
    """Item 9: agent.py passes `last_call_timeout` (run.last_call_seconds) in RendezvousParameters; the c10d handler reads
    it as `_get_timeout(params, "last_call")` -> `params.get_as_int("last_call_timeout")`. Renamed, torch silently
    waits its own default (30 s) for late nodes."""
    need('_get_timeout(params, "last_call")' in source_of(dynamic_rendezvous, "create_handler"),
         "dynamic_rendezvous.create_handler", "it no longer reads the last_call timeout")
    need('key + "_timeout"' in source_of(dynamic_rendezvous, "_get_timeout"), "dynamic_rendezvous._get_timeout",
         "the rendezvous timeouts are no longer read as `<name>_timeout` keys (last_call_timeout)")


def test_the_agent_hands_our_timer_pipe_to_the_ranks_and_starts_no_server_of_its_own() -> None:
    check_the_watchdog_hand_over()


def test_the_agents_signal_handling_the_ranks_run_id_and_the_last_call_key_are_read_where_we_set_them() -> None:
    check_the_signals_stay_the_agents()
    check_the_ranks_get_the_run_id()
    check_the_last_call_key()


def plant(monkeypatch: pytest.MonkeyPatch, folder: Path, owner: object, name: str, old: str, new: str) -> None:
    """For this test only, `owner.name` becomes a copy of torch's own code in which `old` reads `new`: the change a
    next torch could make. The copy is written to a file, so inspect reads its source as it reads torch's."""
    function = getattr(owner, name)
    text = textwrap.dedent(source(function))
    assert old in text, f"nothing to plant: `{old}` is not in {name}"
    path = folder / f"planted_{name}.py"
    path.write_text(text.replace(old, new), encoding="utf-8")
    namespace = dict(inspect.unwrap(function).__globals__)  # type: ignore[arg-type]
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)  # noqa: S102 - torch's own code
    monkeypatch.setattr(owner, name, namespace[name])


PLANTED = {  # what a next torch could change -> the check that must then fail, and the name its line gives
    "signals renamed": (PContext, "start", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_HANDLED_SIGNALS",
                        check_the_signals_stay_the_agents, "PContext.start"),
    "run id renamed": (LocalElasticAgent, "_start_workers", '"TORCHELASTIC_RUN_ID"', '"TORCHELASTIC_JOB_ID"',
                       check_the_ranks_get_the_run_id, "LocalElasticAgent._start_workers"),
    "last_call key renamed": (dynamic_rendezvous, "create_handler", '"last_call"', '"final_call"',
                              check_the_last_call_key, "dynamic_rendezvous.create_handler"),
    "timeout keys renamed": (dynamic_rendezvous, "_get_timeout", 'key + "_timeout"', 'key + "_wait_s"',
                             check_the_last_call_key, "dynamic_rendezvous._get_timeout"),
    "timer file renamed": (LocalElasticAgent, "_setup_local_watchdog", "TORCHELASTIC_TIMER_FILE",
                           "TORCHELASTIC_TIMER_PIPE", check_the_watchdog_hand_over,
                           "LocalElasticAgent._setup_local_watchdog"),
}


def guard_line(check: Callable[[], None]) -> str:
    with pytest.raises(AssertionError) as failed:
        check()
    return str(failed.value)


@pytest.mark.parametrize("planted", list(PLANTED))
def test_each_guarded_name_planted_away_fails_with_the_guards_line(planted: str, monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    owner, name, old, new, check, what = PLANTED[planted]
    check()  # torch as installed: passes
    plant(monkeypatch, tmp_path, owner, name, old, new)
    line = guard_line(check)
    assert line.startswith(f"torch {TORCH} changed {what}: ") and "\n" not in line, line


def test_a_watchdog_set_up_torch_renamed_fails_with_the_guards_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, `LocalElasticAgent._setup_local_watchdog` gone was a bare AttributeError."""
    monkeypatch.delattr(LocalElasticAgent, "_setup_local_watchdog")
    assert guard_line(check_the_watchdog_hand_over) == changed("LocalElasticAgent._setup_local_watchdog",
                                                               "it is gone")


def test_the_ranks_get_the_variables_deepspeeds_are_derived_from() -> None:
    """Public: the rank derives LOCAL_SIZE / CROSS_RANK / CROSS_SIZE (pretrain/distributed/process_group.py) from
    these; torch sets them in `_start_workers`. And Worker.id is the rank's pid under a local agent."""
    starting = source_of(LocalElasticAgent, "_start_workers")
    for name in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "RANK"):
        assert f'"{name}"' in starting, changed("LocalElasticAgent._start_workers", f"it no longer sets {name}")
    assert "worker.id = " in source_of(SimpleElasticAgent, "_initialize_workers"), changed(
        "SimpleElasticAgent._initialize_workers", "Worker.id is no longer the id _start_workers returns (the pid)")
    worker = Worker(local_rank=0, global_rank=3, role_rank=3, world_size=4, role_world_size=4)
    assert (worker.id, worker.global_rank, worker.world_size) == (None, 3, 4)
    group = WorkerGroup(WorkerSpec(role="r", local_world_size=1, rdzv_handler=None, entrypoint="x"))  # type: ignore
    assert all(hasattr(group, name) for name in ("workers", "group_world_size", "state", "spec")), changed(
        "WorkerGroup", "its fields")
    assert callable(SimpleElasticAgent.get_worker_group)


def test_the_ranks_own_store_per_attempt_and_a_rendezvous_that_is_not_the_agents() -> None:
    """Item 6, and the c10d rendezvous's `is_host` (the nodes join launch.sh's store as clients) and shutdown (a final
    verdict closes the rendezvous)."""
    found = [path for path in (dynamic_rendezvous.__file__, agent_api.__file__, c10d_rendezvous_backend.__file__)
             if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in open(path, encoding="utf-8").read()]
    assert found, changed("the rendezvous", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE is read nowhere any more")
    assert 'get_as_bool("is_host")' in source_of(c10d_rendezvous_backend, "_create_tcp_store"), changed(
        "the c10d rendezvous backend", "it no longer reads is_host")
    params = RendezvousParameters("c10d", "h:1", "run", 1, 2, local_addr="a", is_host=False, last_call_timeout=10)
    assert params.local_addr == "a" and params.get_as_bool("is_host") is False
    assert callable(RendezvousHandler.shutdown) and issubclass(RendezvousClosedError, RendezvousError)
    assert "master_listen_fd" in (torch.distributed.TCPStore.__init__.__doc__ or ""), changed(
        "TCPStore", "no master_listen_fd: pretrain/launch/store.py cannot take over launch.sh's socket")


def test_the_public_pieces_the_agent_builds_on_keep_their_shape() -> None:
    assert {"reify", "root_log_dir"} <= set(dir(LogsSpecs)), changed("LogsSpecs", "reify / root_log_dir")
    assert {"stdouts", "stderrs", "error_files"} <= set(parameters(LogsDest)), changed("LogsDest", "its fields")
    assert {"pid", "exitcode"} <= set(parameters(ProcessFailure)), changed("ProcessFailure", "its fields")
    assert "sigval" in parameters(SignalException), changed("SignalException", "its fields")
    # the agent hands it the hang limit: without it torch's check of a rank stuck in D state is off
    assert "uninterruptible_state_timeout" in parameters(LocalElasticAgent), changed(
        "LocalElasticAgent", "its uninterruptible_state_timeout argument")


def test_our_timer_server_still_fits_torchs() -> None:
    """The subclass itself: built, started and stopped on a real pipe, its overrides torch's names."""
    from pretrain.launch.hang_watch import HangWatch, Limits  # torch and the standard library only

    for name in ("_reap_worker", "register_timers"):
        assert name in vars(HangWatch) and hasattr(FileTimerServer, name)
    watch = HangWatch(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"guard-{os.getpid()}"), Limits(60.0, 600.0))
    watch.start()
    try:
        watch.arm(os.getpid(), 0)  # through the pipe, as a rank's own request
    finally:
        watch.stop()
