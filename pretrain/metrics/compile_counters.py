"""The compiled encoder layer's counters, a step monitor (pretrain/metrics/monitor_contract.py).

Why logged every step: a recompile or a fallback to eager is a silent slowdown, visible only as a counter that
moves. The counters are the process's (pretrain/model/compiled.py `CompileLedger`): cumulative, host numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.model.compiled import compile_metrics
from pretrain.step_stats import StepResult


class CompileCounters(StepMonitor):
    """torch.compile's counters of the encoder layer, cumulative over the process; nothing when the layers run eager.

    Tags:
        compile/graph_breaks      [compiled] dynamo's graph breaks in this process (the layer has none by construction)
        compile/recompiles        [compiled] the layer's graphs compiled after its first (a new max_seqlen, phase 2)
        compile/seconds           [compiled] seconds spent compiling
        compile/fallback          [compiled] 1 once the layer runs eager after a failed compile
        compile/recompile_limit   [compiled] 1 once dynamo's recompile limit was hit
    """

    model: torch.nn.Module | None = None

    def attach(self, engine: Any) -> None:
        self.model = engine.module

    def values(self, result: StepResult) -> dict[str, float]:
        return {} if self.model is None else compile_metrics(self.model)
