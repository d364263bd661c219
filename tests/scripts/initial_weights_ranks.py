"""Launched on 2 CPU ranks by tests/pretrain/test_initial_weights.py: a phase's initial weights are read once.

    python initial_weights_ranks.py WORK

`pretrain.checkpointing.weights_source.load_initial_weights` with a reader that logs which rank called it: only rank 0 may
read (rank 1 receives the weights by broadcast), and every rank must end with rank 0's weights.
Then a reader that fails on rank 0: every rank must raise the same ConfigError (none may hang).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpointing.weights_source import load_initial_weights
from pretrain.distributed.process_group import init_distributed
from pretrain.errors import ConfigError
from pretrain.model.bert import bert_config, build_model
from tests.support.launching import leave_without_teardown


def run(work: Path) -> None:
    info = init_distributed()
    config = bert_config("tiny", vocab_size=48, max_position_embeddings=64)
    torch.manual_seed(123)
    source = build_model(config).state_dict()  # the "checkpoint" (rank 0 reads it)
    torch.manual_seed(1000 + info.rank)  # each rank starts from different weights
    model = build_model(config)

    def read() -> dict[str, torch.Tensor]:
        with open(work / "reads.txt", "a") as log:
            log.write(f"{info.rank}\n")
        return source

    load_initial_weights(model, read, "test weights", info, src=0, group=None)
    differences = {name: float((value - source[name]).abs().max()) for name, value in model.state_dict().items()
                   if name in source}

    def broken() -> dict[str, torch.Tensor]:
        raise FileNotFoundError("phase1-step0000004: rank 0 could not read it")

    try:
        load_initial_weights(build_model(config), broken, "test weights", info, src=0, group=None)
        error = None
    except ConfigError as err:
        error = str(err)
    (work / f"rank{info.rank}.json").write_text(json.dumps({"max_difference": max(differences.values()),
                                                            "keys": len(differences), "error": error}))
    dist.barrier()


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    leave_without_teardown()
