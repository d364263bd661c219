"""What the step's rows held, a step monitor (pretrain/metrics/monitor_contract.py): how well packing fills them.

From the step's counts, summed over the ranks by its one all-reduce (pretrain/step_stats.py `StepCounts`):
host arithmetic only. Packing and the unpadded path exist to cut padding; these two numbers say whether they do.
"""

from __future__ import annotations

from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.step_stats import StepResult


class DataStats(StepMonitor):
    """Instances per row and the padding share of the step's rows, over every rank.

    Tags:
        data/packing_factor    instances per row the devices ran (1 unpacked; more when packed or unpadded)
        data/padding_fraction  the padding share of the rows' tokens (the unpadded path's bucket tail)
    """

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len  # the phase's row length: what a row of padding is measured against

    def values(self, result: StepResult) -> dict[str, float]:
        return result.counts.data_stats(self.seq_len)
