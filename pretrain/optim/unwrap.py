"""The client optimizer behind a built DeepSpeed engine, and what it reports after each step, without importing
DeepSpeed (pretrain/engine.py builds the engine).

The trainer runs on any object with the engine's methods; it needs DeepSpeed's classes for nothing, so
`import pretrain.trainer` loads no DeepSpeed (tests/pretrain/test_extensions.py checks it). An optimizer
that has numbers of its own to log (ExactLamb's trust ratios) says so with a `step_metrics()` method
(`ReportsMetrics`); the trainer asks for `optimizer_metrics(engine)` once and calls it after every step,
without knowing which optimizer it runs (a monitor, not a type test in the loop).
"""

from __future__ import annotations

from collections.abc import Callable
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


def optimizer_metrics(engine: Any) -> Callable[[], OptimizerMetrics]:
    """What the engine's client optimizer reports after a step: its own `step_metrics`, or nothing."""
    optimizer = client_optimizer(engine)
    return optimizer.step_metrics if isinstance(optimizer, ReportsMetrics) else OptimizerMetrics


def unwrapped_grad_norm(engine: Any) -> torch.Tensor | None:
    """The global gradient norm (before clipping) where DeepSpeed reports none: an engine without an optimizer
    wrapper (ZeRO-0 in fp32). Called after the boundary backward (gradients averaged over the ranks) and before
    `engine.step()`; stays on the device until the step's host read."""
    if engine.optimizer is not client_optimizer(engine):
        return None
    grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
