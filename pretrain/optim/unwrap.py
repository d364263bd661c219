"""The client optimizer behind a built DeepSpeed engine, and what it reports after each step, without importing
DeepSpeed (pretrain/engine.py builds the engine).

The trainer runs on any object with the engine's methods; it needs DeepSpeed's classes for nothing, so
`import pretrain.trainer` loads no DeepSpeed (tests/pretrain/test_extensions.py checks it). An optimizer
that has numbers of its own to log (ExactLamb's trust ratios) says so with a `step_metrics()` method
(`ReportsMetrics`); a step monitor asks for it once and logs it after every step, without the trainer knowing
which optimizer it runs (pretrain/metrics/optimizer_report.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class OptimizerMetrics:
    """An optimizer's numbers after a step: scalars by TensorBoard tag, and tensors logged as histograms."""

    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class ReportsMetrics(Protocol):
    def step_metrics(self) -> OptimizerMetrics:
        """This optimizer's numbers about its last step."""
        ...


def client_optimizer(engine: Any) -> torch.optim.Optimizer:
    """Our ExactLamb (or the torch optimizer DeepSpeed built) behind the engine's ZeRO/fp16 wrappers."""
    optimizer = getattr(engine, "basic_optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"engine has no client torch optimizer (found {type(optimizer).__name__})")
    return optimizer
