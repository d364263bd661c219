"""Launched by tests/model/test_unpadded_runs.py on 1 or 2 CPU ranks: real runs of `pretrain.train.main`,
the padded eager reference against the unpadded compiled path, dropout off (RUN.jsons written by the test).

    pure WORKDIR    padded.json (model.attention=padded) and unpadded.json (model.compile=true), both to the end
    crossing WORKDIR  padded.json to the end; unpadded.json (compiled) stopped after 4 steps, resumed
                    padded/eager for 4 steps (into phase 2), then resumed unpadded/compiled to the end: a
                    checkpoint moves from each path to the other
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from pretrain.train import main
from tests.support.launching import leave_without_teardown

PADDED = ["--model.attention=padded"]
COMPILED = ["--model.compile=true"]


def run(argv: list[str]) -> None:
    mode, workdir = argv[0], Path(argv[1])
    outcomes = {"padded": main(["--config", str(workdir / "padded.json"), *PADDED])}
    unpadded = ["--config", str(workdir / "unpadded.json")]
    if mode == "pure":
        outcomes["unpadded"] = main([*unpadded, *COMPILED])
    elif mode == "crossing":
        outcomes["unpadded_first_4"] = main([*unpadded, *COMPILED, "--run.stop_after_steps=4"])
        outcomes["padded_next_4"] = main([*unpadded, *PADDED, "--run.stop_after_steps=4"])
        outcomes["unpadded_rest"] = main([*unpadded, *COMPILED])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if dist.get_rank() == 0:
        (workdir / "outcomes.json").write_text(json.dumps(outcomes))


if __name__ == "__main__":
    run(sys.argv[1:])
    leave_without_teardown()
