"""The ranks of `./launch.sh pretrain` on one node, under torch's elastic agent: restarts, hangs, one line each.

    python -m pretrain.launch.agent --nproc-per-node N --master-addr A --master-port P
        [--nnodes N|MIN:MAX --job MARK (--node HOST | --slurm)] [--resume-command TEXT]
        -- --config RUN.json [--section.key=value ...]

launch.sh runs this instead of a bare launcher: itself on one machine; on several nodes
pretrain/launch/nodes.py runs one per node (over pdsh with --node, or as the node's srun task with --slurm). It
reads the run config (run.max_restarts, run.hang_timeout_minutes, run.dir) and hands the ranks (`python -m pretrain.train ARGS`) to torch's
`LocalElasticAgent`, which starts them, watches them, and restarts the whole group from the newest
checkpoint when one dies. What is ours on top (HealingAgent):

- every failure becomes one line (pretrain/launch/faults.py): which rank and host, how it died, at which
  step, the checkpoint it restarts from, "restart k of N"; when no restart is left, one error line with
  the command that resumes, and the job's exit status is the rank's. A config error the ranks find is
  printed once, exit 2, never restarted. The rank's stderr (tracebacks, warnings, a C++ `terminate
  called`) goes to RUN/logs/<launch>/attempt-K/rank-R.log, named in that line; stdout stays on the
  terminal. torch's own log lines go to RUN/logs/<launch>/agent.log.
- hangs: each step after a launch's first runs under torch's expiration timer (pretrain/distributed/step_watch.py,
  `TORCHELASTIC_TIMER_FILE`); the timer server lives here, outside the ranks, so a rank frozen by SIGSTOP or
  stuck in a collective is found. torch's server kills a rank whose timer ran out and then its own
  process (the agent); ours (HangWatch) kills the rank only, and remembers which step each rank was in.
- signals: launch.sh passes SIGINT/SIGTERM/SIGUSR1/SIGHUP to this process, which passes them on to the
  ranks (they checkpoint at the step boundary and exit 0) and restarts nothing after. SIGINT goes as SIGTERM
  to a rank that has no handler yet (still importing torch).

Why torch's agent and not a loop of our own: it already stops every rank when one dies, restarts the group
with a fresh rendezvous, counts restarts, and serves the hang timers; a launch that runs it is the
documented torchrun path (`--max-restarts`), also for the nodes of a hostfile later.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry
from torch.distributed.elastic.timer import FileTimerServer

from pretrain.config.cli import parse_args
from pretrain.config.load import load_config
from pretrain.distributed.step_watch import HANG_TIMEOUT_ENV
from pretrain.errors import USER_ERROR_EXIT, UserError
from pretrain.launch.faults import (
    FailureRecord,
    FaultContext,
    RankFailure,
    Verdict,
    hang_description,
    judge,
    primary_failure,
    process_state,
    worker_env_extras,
)
from pretrain.launch.nodes import node_range
from pretrain.run_folder import last_failure_path, launch_logs_dir

PREFIX = "launch.sh"
LAST_CALL_SECONDS = 10  # with --nodes MIN:MAX: how long a rendezvous that has MIN nodes waits for more
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def say(line: str) -> None:
    print(f"{PREFIX}: {line}", file=sys.stderr, flush=True)


class RankLogs(LogsSpecs):
    """Each rank's stderr to LAUNCH_DIR/attempt-K/rank-R.log (R: its global rank); stdout to the terminal."""

    def __init__(self, folder: Path) -> None:
        super().__init__(log_dir=str(folder))
        self.folder = folder

    @property
    def root_log_dir(self) -> str:
        return str(self.folder)

    def path(self, attempt: int | str, rank: int | str) -> Path:
        return self.folder / f"attempt-{attempt}" / f"rank-{rank}.log"

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        stderrs, errors = {}, {}
        for local_rank, env in envs.items():
            log = self.path(env["TORCHELASTIC_RESTART_COUNT"], env["RANK"])
            log.parent.mkdir(parents=True, exist_ok=True)
            stderrs[local_rank] = str(log)
            errors[local_rank] = str(log.with_suffix(".error.json"))
        return LogsDest(stdouts=dict.fromkeys(envs, ""), stderrs=stderrs, error_files=errors)


class HangWatch(FileTimerServer):
    """torch's timer server, minus killing its own process, plus what the fault line needs: the step each
    rank announced last (its timer's scope) and how each killed rank looked ('T': stopped)."""

    def __init__(self, file_path: str, run_id: str, timeout_s: float) -> None:
        super().__init__(file_path, run_id, max_interval=0.1, daemon=True)
        self.timeout_s = timeout_s
        self.last_step: dict[int, str] = {}
        self.hung: dict[int, str] = {}

    def register_timers(self, timer_requests: list[Any]) -> None:
        for request in timer_requests:
            if request.expiration_time >= 0:
                self.last_step[request.worker_pid] = request.scope_id
        super().register_timers(timer_requests)

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():  # torch ends the agent too; we restart instead
            return True
        self.hung.setdefault(worker_pid, self.no_progress(worker_pid))
        # A rank frozen between two steps holds no timer; the peer waiting for it in a collective times out
        # instead. Name the frozen one too (primary_failure puts a stopped rank first).
        for pid in self.last_step:
            if pid != worker_pid and process_state(pid) in ("T", "t"):
                self.hung.setdefault(pid, self.no_progress(pid))
        return super()._reap_worker(worker_pid, signal)

    def no_progress(self, pid: int) -> str:
        return f"made no progress in {self.timeout_s / 60:g} min ({hang_description(process_state(pid))})"


class HealingAgent(LocalElasticAgent):
    """LocalElasticAgent whose failures are judged (faults.judge) and told in one line each."""

    def __init__(self, spec: WorkerSpec, logs: RankLogs, context: FaultContext, record: FailureRecord,
                 shutdown_timeout: int, host: str) -> None:
        super().__init__(spec, logs, shutdown_timeout=shutdown_timeout)
        self.logs, self.context, self.record, self.host = logs, context, record, host
        self.verdict: Verdict | None = None
        self.stop_signal: int | None = None
        self.watch: HangWatch | None = None
        self.pids: dict[int, int] = {}  # global rank -> pid of the running group

    # ------------------------------------------------------------------ what torch calls
    def _set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        group = self._worker_group
        worker_env.update(worker_env_extras(spec.local_world_size, group.group_rank or 0,
                                            group.group_world_size or 1))

    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bert-ds-timers-{uuid.uuid4().hex}")
        self.watch = HangWatch(path, envs[0]["TORCHELASTIC_RUN_ID"] if envs else "",
                               float(os.environ[HANG_TIMEOUT_ENV]))
        self._worker_watchdog = self.watch
        self.watch.start()
        for env in envs.values():
            env["TORCHELASTIC_TIMER_FILE"] = path

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        self.pids = {worker.global_rank: pids[worker.local_rank] for worker in worker_group.workers}
        return pids

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._judge(result)
        return result

    def _restart_workers(self, worker_group: Any) -> None:
        # torch restarts a healthy group without counting it when another node waits in the rendezvous: that
        # node's ranks failed (it counted it). A failed group was counted by torch before this call. Counted here
        # too, every node spends the job's restarts alike and "restart k of N" means the same k on every node.
        if worker_group.state == WorkerState.HEALTHY and self._remaining_restarts > 0:
            self._remaining_restarts -= 1
        super()._restart_workers(worker_group)

    # ------------------------------------------------------------------ ours
    def _failures(self, result: RunResult) -> list[RankFailure]:
        steps, hung = (self.watch.last_step, self.watch.hung) if self.watch else ({}, {})
        attempt = self._worker_group.spec.max_restarts - self._remaining_restarts
        failed = [RankFailure(rank, self.host, failure.exitcode, steps.get(failure.pid), self.logs.path(attempt, rank),
                              hung.get(failure.pid)) for rank, failure in result.failures.items()]
        # A frozen rank named by the timers has not ended yet (the agent's stop kills it): it is a failure too.
        return failed + [RankFailure(rank, self.host, -signal.SIGKILL, steps.get(pid), self.logs.path(attempt, rank),
                                     hung[pid]) for rank, pid in self.pids.items()
                         if pid in hung and rank not in result.failures]

    def _judge(self, result: RunResult) -> None:
        failures = self._failures(result)
        if self.stop_signal is not None:  # asked to stop: whatever the ranks did, no restart
            self._remaining_restarts = 0
            self.verdict = Verdict(False, "", 128 + self.stop_signal)
            return
        if not failures:  # torch's own verdict: a rank stuck in uninterruptible sleep (D state); it restarts nothing
            self.verdict = Verdict(False, f"error: a rank of host {self.host} stayed in uninterruptible I/O (D state); "
                                          f"no restart; resume with: {self.context.resume_command}", 1)
            say(self.verdict.line)
            return
        restarts_done = self._worker_group.spec.max_restarts - self._remaining_restarts
        self.verdict = judge(primary_failure(failures), restarts_done, self.context, self.record)
        # A user error is every rank's (rank 0 checks and shares its verdict): told once, by the first node.
        if self.verdict.exit_status != USER_ERROR_EXIT or not self._worker_group.group_rank:
            say(self.verdict.line)
        if not self.verdict.restart:
            self._remaining_restarts = 0

    def forward(self, signum: int, _frame: Any = None) -> None:
        """launch.sh's signal, passed on to every rank; nothing is restarted after it."""
        self.stop_signal = self.stop_signal or signum
        if not any(Path(f"/proc/{pid}").exists() for pid in self.pids.values()):  # in a rendezvous: end it
            raise SignalException(f"{signal.Signals(signum).name} between attempts", signal.Signals(signum))
        for pid in self.pids.values():
            sent = signum
            if signum == signal.SIGINT and not catches(pid, signal.SIGTERM):
                sent = signal.SIGTERM  # still importing: no handler yet, a KeyboardInterrupt traceback otherwise
            try:
                os.kill(pid, sent)
            except ProcessLookupError:
                pass


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (SigCgt of /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool((int(line.split()[1], 16) >> (signum - 1)) & 1)
    except (OSError, ValueError):
        pass
    return False


def quiet_torch_logs(path: Path) -> None:
    """torch's elastic logs (rendezvous, restarts, its failure tables) to a file, not the terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def build_agent(args: argparse.Namespace, module_args: list[str]) -> HealingAgent:
    config = load_config(*parse_args(module_args))  # the ranks read it again; a UserError here is one line
    node = os.environ.get("SLURMD_NODENAME", "") if args.slurm else args.node  # a name only on 2+ nodes
    host = node or socket.gethostname()
    node_mark = f"-{node}" if node else ""  # the nodes of a multi-node job share the run folder
    launch_dir = launch_logs_dir(Path(config.run.dir), time.strftime("%Y%m%d-%H%M%S") + node_mark)
    quiet_torch_logs(launch_dir / "agent.log")
    os.environ["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"
    os.environ[HANG_TIMEOUT_ENV] = str(config.run.hang_timeout_minutes * 60)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"  # the others: forwarded by HealingAgent.forward
    # c10d rendezvous, and a store of the ranks' own on a fresh port at each attempt: torch's shared agent
    # store would keep the previous attempt's keys (a restarted gloo mesh then dials the dead ranks' ports).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    low, high = node_range(args.nnodes) or (1, 1)
    # The first node serves the rendezvous (on one machine: this one; SLURM: the step's node 0); a multi-node
    # job's run id is its mark. Under SLURM the ranks' own store is on torch's choice of address (the fqdn).
    is_host = os.environ.get("SLURM_NODEID", "0") == "0" if args.slurm else not args.node or args.node == args.master_addr
    local_addr = None if args.slurm else args.node or args.master_addr
    parameters = RendezvousParameters(backend="c10d", endpoint=f"{args.master_addr}:{args.master_port}",
                                      run_id=args.job or f"bert-{uuid.uuid4().hex[:12]}", min_nodes=low,
                                      max_nodes=high, local_addr=local_addr, is_host=is_host,
                                      last_call_timeout=LAST_CALL_SECONDS)
    # SLURM gave the node's task all its ranks' CPUs: each rank takes its own share (pretrain/launch/pin.py), as
    # SLURM's per-task binding did when every rank was a task.
    rank = ("-u", "-m", "pretrain.train", *module_args)
    spec = WorkerSpec(role="rank", local_world_size=args.nproc_per_node, entrypoint=sys.executable,
                      args=("-u", "-m", "pretrain.launch.pin", "--", *rank) if args.slurm else rank,
                      rdzv_handler=rendezvous_registry.get_rendezvous_handler(parameters),
                      max_restarts=config.run.max_restarts, monitor_interval=0.2, local_addr=local_addr)
    logging.getLogger("torch.distributed.elastic").info("ranks run: %r", [sys.executable, *spec.args])
    context = FaultContext(config.run.max_restarts, config.checkpoint_dir, args.resume_command)
    record = FailureRecord(last_failure_path(Path(config.run.dir), node_mark))
    grace = int(float(os.environ.get("BERT_DS_KILL_GRACE_SECONDS", "30")))
    return HealingAgent(spec, RankLogs(launch_dir), context, record, grace, host)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    module_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--resume-command", default="the same command again")
    parser.add_argument("--nnodes", default="", help="multi-node jobs: N or MIN:MAX nodes (pretrain/launch/nodes.py)")
    parser.add_argument("--node", default="", help="hostfile jobs: this node's name in the hostfile")
    parser.add_argument("--job", default="", help="multi-node jobs: the launch's mark (rendezvous id, signals)")
    parser.add_argument("--slurm", action="store_true",
                        help="one task of a SLURM step (pretrain/launch/transports.py): node name from SLURMD_NODENAME,"
                             " node 0 serves the rendezvous, each rank pinned to its share of the task's CPUs")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        agent = build_agent(args, module_args)
    except UserError as err:
        say(err.line())
        return 2
    for signum in FORWARDED:
        signal.signal(signum, agent.forward)
    try:
        result = agent.run()
    except SignalException as stopped:
        return 128 + stopped.sigval
    if not result.is_failed():
        if agent.stop_signal is None:
            agent.record.clear()
        return 0  # launch.sh makes it 130 after a Ctrl-C
    verdict = agent.verdict
    return verdict.exit_status if verdict is not None else 1


if __name__ == "__main__":
    sys.exit(main())
