"""Launched on 2 CPU ranks by tests/checkpointing/test_footprint.py: failed writes during a collective save.

    python checkpoint_fault_ranks.py WORK

Real faults, no mock: a directory where a file must go makes that write fail with an OSError.
1. Rank 1's optimizer partition cannot be written (a directory at its name): the save fails on both
   ranks, rank 0's files of the tag are deleted, `latest` stays, nobody waits in a barrier.
2. Rank 0's copy of DeepSpeed's zero_to_fp32.py into the folder fails (the one write outside the
   checkpoint engine, after which DeepSpeed's save would have left its final barrier): the same.
3. A save the run cannot do without fails: SaveError on both ranks, the same message.
4. The obstacles removed, the next save commits.
Each rank writes what it saw to rank<R>.json.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpointing.checkpoint import CheckpointManager, SaveError
from pretrain.distributed.process_group import init_distributed
from pretrain.engine import build_engine
from pretrain.model.bert import bert_config, build_model
from tests.support.launching import leave_without_teardown
from tests.support.paths import REPO_ROOT


def run(work: Path) -> None:
    info = init_distributed()
    torch.manual_seed(0)
    ds = json.loads((REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, zero_allow_untested_optimizer=True)
    engine = build_engine(build_model(bert_config("tiny", 48, 64)), ds)
    root = work / "checkpoints"
    manager = CheckpointManager(root, keep_last=1, rank=info.rank)
    run_config = {"resolved": {"world_size": info.world_size}}

    def save(step: int, may_fail: bool = True) -> bool:
        return manager.save(engine, f"phase1-step{step:07d}", {"step": step}, run_config, False, may_fail) is not None

    seen: dict[str, object] = {"first": save(1)}
    if info.rank == 1:  # 1. rank 1's partition of the next tag has a directory in its way
        (root / "phase1-step0000002" / "zero_pp_rank_1_mp_rank_00_optim_states.pt" / "obstacle").mkdir(parents=True)
    dist.barrier()
    seen["rank1_fails"] = save(2)
    seen["latest_after_1"] = (root / "latest").read_text()
    seen["folder_after_1"] = (root / "phase1-step0000002").exists()
    if info.rank == 0:  # 2. zero_to_fp32.py cannot be copied into the folder
        (root / "zero_to_fp32.py").unlink()
        (root / "zero_to_fp32.py" / "obstacle").mkdir(parents=True)
    dist.barrier()
    seen["copy_fails"] = save(3)
    try:  # 3. a required save
        save(3, may_fail=False)
        seen["required"] = None
    except SaveError as err:
        seen["required"] = str(err)
    if info.rank == 0:
        shutil.rmtree(root / "zero_to_fp32.py")
    dist.barrier()
    seen["then"] = save(4)  # 4.
    seen["latest"] = (root / "latest").read_text()
    seen["folders"] = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    (work / f"rank{info.rank}.json").write_text(json.dumps(seen))
    dist.barrier()


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    leave_without_teardown()
