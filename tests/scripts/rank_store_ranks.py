"""Started twice (ranks 0 and 1) by tests/distributed/test_rank_store.py, with the variables our elastic agent
gives its ranks (one machine: MASTER_ADDR 127.0.0.1, a store of the ranks' own): the process group the driver
joins (init_distributed, over gloo), then the JSON collectives over it.

    python rank_store_ranks.py WORK    (WORK/fresh: no checkpoint; WORK/refused: a `latest` naming ../elsewhere)

Prints one line `RESULT {json}`: where the ranks' store listens (rank 0, read from /proc/net/tcp and tcp6 while the
group is up) and what each collective delivered.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch.distributed as dist

from pretrain.checkpointing.commit import agree_on_failures
from pretrain.checkpointing.manifest import resolve_resume_tag
from pretrain.device_check.settle import gather
from pretrain.device_check.verdict import SelfTestResult
from pretrain.distributed.json_collectives import (
    all_gather_bytes,
    all_gather_float32,
    all_gather_json,
    broadcast_json,
)
from pretrain.distributed.process_group import init_distributed
from pretrain.errors import ResumeError
from pretrain.finetune.squad.inference import gather_rows
from tests.support.launching import leave_without_teardown
from tests.support.listening import listening


def main() -> None:
    info = init_distributed()
    rank = info.rank
    result: dict[str, object] = {"rank": rank, "world_size": info.world_size}
    if rank == 0:
        result["listening"] = listening(int(os.environ["MASTER_PORT"]))
    dist.barrier()  # rank 1 still in the group while rank 0 reads the tables
    result["gathered"] = all_gather_json({"rank": rank, "pair": ("tag", rank), "nan": math.nan, "text": "é" * rank})
    result["broadcast"] = broadcast_json(["from rank 1", {"k": [1, 2.5]}] if rank == 1 else None, src=1)
    result["empty"] = [part.hex() for part in all_gather_bytes(b"" if rank == 0 else b"\x00\x01")]
    floats = all_gather_float32(np.arange(rank + 2, dtype=np.float32) / 3)
    result["floats_exact"] = all(np.array_equal(got, np.arange(r + 2, dtype=np.float32) / 3)
                                 for r, got in enumerate(floats))
    rows = [(10 * rank + i, np.full(i + 1, rank + i / 7, np.float32), -np.arange(i + 1, dtype=np.float32) / 3)
            for i in range(rank + 1)]  # rank 0: one window, rank 1: two, of differing lengths
    result["squad_rows"] = [[index, start.tolist(), end.tolist()] for index, start, end in gather_rows(rows)]
    tested = SelfTestResult(False, "cpu fp32", 2e-3, 1e-5, kernel_part="dq") if rank == 1 else None
    verdicts = gather((f"host{rank}", (True, rank == 0), tested, None))  # the plan's self-test verdicts
    result["verdicts"] = [[host, list(planned), None if test is None else [type(test).__name__, repr(asdict(test))],
                           compiled] for host, planned, test, compiled in verdicts]
    work = Path(sys.argv[1])
    result["failures"] = agree_on_failures("rank 1: disk full" if rank == 1 else None)  # a save's verdict
    result["fresh"] = resolve_resume_tag(work / "fresh", rank)  # the resume votes: rank 0 "fresh", rank 1 abstains
    try:
        resolve_resume_tag(work / "refused", rank)
        result["refused_resume"] = None
    except ResumeError as err:  # rank 0's "broken" vote, on every rank
        result["refused_resume"] = str(err)
    try:
        all_gather_json({"a set": {1}})  # refused on the sender, before any collective
        result["refused"] = None
    except TypeError as err:
        result["refused"] = str(err)
    result["after_refusal"] = all_gather_json(rank)  # the ranks are still in step
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
