"""Launched on 2 CPU ranks by tests/finetune/squad/test_finetune.py: one short fine-tune, then one evaluation.

Usage: torchrun --nproc-per-node 2 squad_finetune_ranks.py WORK_DIR
WORK_DIR holds export/ (a tiny BertForPreTraining, our export's layout), qa/ (a tiny
BertForQuestionAnswering), train.json, dev.json and ds.json (engine mechanics; lr 1e-3 and micro-batch 4
x 1 accumulation x 2 ranks = batch 8 are flags). Both runs share one launch to save the launcher's
start-up time.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pretrain.finetune.squad.__main__ import main
from tests.support.launching import leave_without_teardown
from tests.support.squad_fixtures import SHORT_WINDOWS


def run(work: Path) -> None:
    common = ["--dev", str(work / "dev.json"), "--ds-config", str(work / "ds.json"), "--lr", "1e-3",
              "--batch-size", "8", "--micro-batch-size", "4", *SHORT_WINDOWS]
    # 1. Fine-tune our export's layout for a few steps on both ranks, then score.
    code = main(["finetune", "--model", str(work / "export"), "--train", str(work / "train.json"),
                 "--out", str(work / "out_train"), "--max-steps", "6", "--log-every", "2", *common])
    assert code == 0, code
    # 2. Evaluate only: 33 windows in blocks of 17 and 16, batches of 4, so rank 1 runs one padding batch.
    code = main(["finetune", "--model", str(work / "qa"), "--out", str(work / "out_eval"),
                 "--eval-batch-size", "4", *common])
    assert code == 0, code


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    leave_without_teardown()
