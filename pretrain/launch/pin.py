"""One rank of a SLURM node, pinned to its share of the node task's CPUs, then the rank itself.

    python -m pretrain.launch.pin -- -u -m pretrain.train ARGS      (the agent's entrypoint under --slurm)

Under SLURM the agent of a node is one task holding every rank's CPUs (ranks x cpus-per-task). When each rank
was a task of its own, SLURM's task/affinity bound it to its cpus-per-task; this keeps that: the task's CPUs,
in order, split into LOCAL_WORLD_SIZE equal blocks, block LOCAL_RANK for this rank (contiguous blocks keep a
rank's cores together, as SLURM's default block distribution does). Set before the rank's interpreter starts
(exec: same process, so the agent's pid and timers stay valid), so every thread it ever starts inherits it.

Standard library only (and the rank's stop request, itself standard library only).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from pretrain.distributed.stop_request import StopRequest


def share(cpus: Sequence[int], local_rank: int, ranks: int) -> list[int]:
    """Block `local_rank` of `ranks` equal blocks of `cpus` (sorted); all of them when there are fewer CPUs than
    ranks (nothing to split, and a rank with no CPU cannot run)."""
    ordered = sorted(cpus)
    size = len(ordered) // max(ranks, 1)
    if size == 0 or not 0 <= local_rank < ranks:
        return ordered
    return ordered[local_rank * size:(local_rank + 1) * size]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m pretrain.launch.pin -- PYTHON_ARGS...", file=sys.stderr)
        return 2
    local_rank, ranks = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.sched_setaffinity(0, share(os.sched_getaffinity(0), local_rank, ranks))
    StopRequest.ignore_until_installed()  # scancel --signal reaches the rank itself: not its end while it starts
    os.execv(sys.executable, [sys.executable, *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
