"""What the cluster tests share: a toy run config, and reading a run's progress and its rank processes
from outside (metrics.jsonl, `latest`, /proc) while SLURM or pdsh runs it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.cluster.processes import process_environ, processes_mentioning
from tests.support.pretrain_fixtures import tiny_run_config

PHASE1_STEPS, PHASE2_STEPS = 40, 4  # phase 1 long enough that a signal lands inside it


# ---------------------------------------------------------------------------------------------- helpers
def wait_for(check: Callable[[], bool], timeout: float, what: str, context: Callable[[], str] = lambda: "") -> None:
    """Poll `check`; fail with `what` and whatever `context` shows (a job's output) after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{context()}")
        time.sleep(0.2)


def tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(encoding="utf-8", errors="replace")[-chars:] if path.exists() else f"({path} absent)"


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's per-step records in the order written (the file is appended across restarts)."""
    path = run_dir / "tensorboard" / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [record for record in records if "phase" in record]


def latest_checkpoint(run_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """The `latest` tag and its trainer_state.json, or None before the first checkpoint."""
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    tag = pointer.read_text(encoding="utf-8").strip()
    return tag, json.loads((run_dir / "checkpoints" / tag / "trainer_state.json").read_text(encoding="utf-8"))


def run_config(path: Path, shards: Path, run_dir: Path, **sections: dict[str, Any]) -> Path:
    """The tiny two-phase RUN.json, with rare checkpoints/validation (fast) and `sections` merged in."""
    tiny_run_config(path, shards, run_dir, phase1=PHASE1_STEPS, phase2=PHASE2_STEPS)
    config = json.loads(path.read_text(encoding="utf-8"))
    config["checkpoint"].update(every_steps=10)
    config["logging"].update(val_every_steps=20)
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


@dataclass
class RankProbe:
    """What one running rank process was given, read from /proc while it trained."""

    rank: int
    cpus: frozenset[int]
    threads: int | None  # OMP_NUM_THREADS, which launch.sh sets from SLURM's cpus-per-task


def rank_processes(marker: str) -> dict[int, int]:
    """{pid: RANK} of the pretrain.train processes whose command line contains `marker` (the run's config)."""
    ranks = {}
    for pid in processes_mentioning(marker):
        try:
            env = process_environ(pid)
            is_rank = b"pretrain.train" in Path(f"/proc/{pid}/cmdline").read_bytes() and "RANK" in env
        except OSError:
            continue
        if is_rank:
            ranks[pid] = int(env["RANK"])
    return ranks


def probe_ranks(marker: str) -> list[RankProbe]:
    probes = []
    for pid, rank in rank_processes(marker).items():
        try:
            threads = process_environ(pid).get("OMP_NUM_THREADS")
            probes.append(RankProbe(rank, frozenset(os.sched_getaffinity(pid)), int(threads) if threads else None))
        except OSError:
            continue
    return sorted(probes, key=lambda probe: probe.rank)


def kill_leftovers(marker: str) -> None:
    """SIGKILL, by pid, any process still naming this test's folder (ranks reached over ssh included)."""
    for pid in processes_mentioning(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
