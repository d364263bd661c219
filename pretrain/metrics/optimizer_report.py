"""The client optimizer's own numbers after each step (ExactLamb's trust ratios), a step monitor
(pretrain/metrics/monitor_contract.py).

An optimizer that has numbers of its own says so with a `step_metrics()` method (pretrain/optim/unwrap.py
`ReportsMetrics`); this monitor asks once, at attach, and the trainer never asks which optimizer it runs.
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.optim.unwrap import OptimizerMetrics, ReportsMetrics, client_optimizer
from pretrain.step_stats import StepResult


class OptimizerReport(StepMonitor):
    """What the engine's client optimizer reports about its last step; nothing for one that reports nothing.
    ExactLamb's trust ratios are over the parameters that get one: under the default `adapt_all: false` not
    the biases and LayerNorm, whose ratio is fixed at 1 and would pull the minimum and mean towards it.

    Tags:
        lamb/trust_ratio_min   [ExactLamb] the smallest trust ratio of the step
        lamb/trust_ratio_mean  [ExactLamb] their mean
        lamb/trust_ratio_max   [ExactLamb] the largest
        lamb/trust_ratio       [ExactLamb, histogram] every one of them, one value per parameter tensor
    """

    def __init__(self) -> None:
        self.optimizer: ReportsMetrics | None = None
        self._histograms: dict[str, torch.Tensor] = {}  # the last report's

    def attach(self, engine: Any) -> None:
        optimizer = client_optimizer(engine)
        self.optimizer = optimizer if isinstance(optimizer, ReportsMetrics) else None

    def values(self, result: StepResult) -> dict[str, float]:
        report = self.optimizer.step_metrics() if self.optimizer is not None else OptimizerMetrics()
        self._histograms = report.histograms
        return dict(report.scalars)

    def histograms(self) -> dict[str, torch.Tensor]:
        return self._histograms
