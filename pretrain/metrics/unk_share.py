"""The share of [UNK] among each step's real input tokens: a tokenizer that does not fit the corpus shows here.

A WordPiece vocab built on another corpus (or a wrong lowercasing) maps whole words to [UNK]; the model then
learns to predict [UNK] and the loss looks fine. The share is counted on the host copy of every micro-batch (no
device work) and summed over the ranks in the step's one all-reduce (`counts`, pretrain/metrics/monitor_contract.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pretrain.metrics.monitor_contract import StepContext, StepMonitor
from pretrain.step_stats import StepResult

UNK, REAL = "unk_share/unk", "unk_share/real"


class UnkShare(StepMonitor):
    """[UNK] tokens over real tokens of the step's inputs, all ranks (masked positions count as fed: [MASK]).

    Tags:
        data/unk_fraction      share of the step's real input tokens that are [UNK] (0 for a vocab without one)
    """

    counts = (UNK, REAL)

    def count(self, host_batch: dict[str, torch.Tensor], step: StepContext) -> dict[str, float]:
        """Counted in numpy on the host copy: not even a host tensor's item() (a device read once it is on a GPU)."""
        ids = host_batch["input_ids"].numpy()
        if "cu_seqlens" in host_batch:  # unpadded: the real tokens lead, the bucket's tail is padding
            real = int(host_batch["cu_seqlens"].numpy()[-2])
            ids = ids.reshape(-1)[:real]
        else:
            mask = host_batch["attention_mask"].numpy().astype(bool)
            real, ids = int(mask.sum()), ids[mask]
        unk = 0 if step.vocab.unk_id is None else int(np.count_nonzero(ids == step.vocab.unk_id))
        return {UNK: float(unk), REAL: float(real)}

    def values(self, result: StepResult) -> dict[str, float]:
        counted: dict[str, Any] = result.counted
        if not counted.get(REAL):
            return {}
        return {"data/unk_fraction": counted[UNK] / counted[REAL]}
