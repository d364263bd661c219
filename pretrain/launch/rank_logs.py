"""Where a launch's evidence goes: each rank's stderr (its tracebacks, and its stacks when it hung), torch's own log
lines, and on GPUs NCCL's flight recorder, all in the launch's folder RUN/logs/<launch time>[-<node>]/:

    attempt-K/rank-R.log      rank R's stderr in attempt K (the agent's restarts count K)
    agent.log                 torch's elastic agent: rendezvous, restarts, the ranks' command line
    nccl-trace-rank-R         NCCL's recent collectives of rank R, when it dumped them (a collective's timeout,
                              or the agent's request before it kills a hung rank)

The ranks' stdout stays on the terminal. Used by pretrain/launch/agent.py.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

NCCL_PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"  # the prefix of each rank's NCCL dump pipe (<prefix><rank>.pipe)


NCCL_TRACE = "nccl-trace-rank-"  # in a launch's log folder: NCCL's flight recorder dump, + the rank


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


def nccl_trace(rank: int) -> Path | None:
    """Where NCCL's flight recorder dumps `rank`'s trace (its dump file's prefix + the rank)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    return Path(f"{prefix}{rank}") if prefix else None


def flight_recorder(launch_dir: Path) -> dict[str, str]:
    """NCCL's flight recorder for GPU ranks, unless the user configured it: a trace of recent collectives, dumped
    into this launch's log folder when a collective times out or when the agent asks before it kills a hung rank
    (a word on the dump pipe, node-local). Each setting under both of torch's names (2.13 renamed some)."""
    trace, pipe = str(launch_dir / NCCL_TRACE), os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                            f"bert-ds-nccl-{uuid.uuid4().hex[:12]}-rank-")
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": trace, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace, NCCL_PIPE_ENV: pipe}


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
