"""The global gradient norm before clipping, at every ZeRO stage: a step monitor (pretrain/metrics/monitor_contract.py).

Two paths, one tag. DeepSpeed's optimizer wrappers (ZeRO-1/2/3, BF16_Optimizer, fp16) compute the norm in
their step, over every rank's partition, and report it (`engine.get_global_grad_norm()`). Without a wrapper
(ZeRO-0 in fp32) DeepSpeed reports none, so the monitor computes it in `before_step`: the gradients are then
averaged over the ranks and not yet clipped, and the norm stays on the device until the step's host read.
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.optim.unwrap import client_optimizer
from pretrain.step_stats import StepResult


class GradNorm(StepMonitor):
    """The global gradient norm of the step, before clipping (the number the clipping threshold is compared with).

    Tags:
        grad_norm  the global gradient norm before clipping: DeepSpeed's where a wrapper reports it, else computed
    """

    def __init__(self) -> None:
        self.engine: Any = None
        self.unwrapped = False  # no optimizer wrapper: DeepSpeed reports no norm
        self._norm: torch.Tensor | None = None

    def attach(self, engine: Any) -> None:
        self.engine = engine
        self.unwrapped = engine.optimizer is client_optimizer(engine)

    def before_step(self) -> None:
        if self.unwrapped:
            self._norm = unwrapped_grad_norm(self.engine.module)

    def values(self, result: StepResult) -> dict[str, float]:
        norm = self._norm if self.unwrapped else self.engine.get_global_grad_norm()
        return {} if norm is None else {"grad_norm": float(norm)}


def unwrapped_grad_norm(model: torch.nn.Module) -> torch.Tensor | None:
    """The global norm of `model`'s gradients as they are (the engine without a wrapper: averaged over the ranks
    by the boundary backward, not yet clipped); None when no parameter has one. Device work only."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
