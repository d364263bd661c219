"""Textbook LAMB: a per-tensor Python loop with one trust ratio per tensor it is handed.

The reference ExactLamb (`pretrain.optim.lamb`) is measured against, written the way LAMB is usually
written and sharing no code with pretrain/optim/lamb.py or pretrain/optim/lamb_math.py, so a mistake there cannot
hide in both. One copy serves three uses:

* tests/optim/test_lamb.py runs it in float64 as the ground truth of the math (every option of ExactLamb's);
* tests/scripts/lamb_zero_equality.py hands it to DeepSpeed directly, as a ZeRO user would: it then
  computes one ratio per flat partition, which is what ExactLamb exists to avoid;
* bench/lamb_step.py times it as the slow baseline.

Nothing on the training path imports this module: tests/ and bench/ import pretrain/, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class NaiveLamb(torch.optim.Optimizer):
    """LAMB (You et al., ICLR 2020), per tensor; the options mean what they mean for ExactLamb.

        m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
        u = m_hat / (sqrt(v_hat) + eps) + wd * w     (m_hat, v_hat bias-corrected when bias_correction)
        ratio = ||w|| / ||u||  (1 when either is 0; clamped to trust_clip; 1 when not adapted)
        w -= lr * ratio * u

    adapt_all=False (the default, as ExactLamb's) leaves the ratio at 1 for groups with weight_decay 0
    (apex FusedLAMB's use_nvlamb=False); adapt_all=True adapts every tensor.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        trust_clip: tuple[float, float] | None = None,
        adapt_all: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, trust_clip=trust_clip, adapt_all=adapt_all)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            adapt = group["adapt_all"] or group["weight_decay"] != 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["t"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat, v_hat = st["m"], st["v"]
                if group["bias_correction"]:
                    m_hat, v_hat = m_hat / (1 - b1 ** st["t"]), v_hat / (1 - b2 ** st["t"])
                u = m_hat / (v_hat.sqrt() + group["eps"])
                u.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), u.norm()
                # a tensor, not .item(): no host sync per tensor, so the benchmark times the math
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                if group["trust_clip"] is not None:
                    ratio = ratio.clamp(*group["trust_clip"])
                if not adapt:
                    ratio = torch.ones_like(ratio)
                st["ratio"] = ratio
                p.sub_(u * (group["lr"] * ratio))

    def last_trust_ratios(self) -> torch.Tensor:
        """The ratio of every tensor at its last step, in group then parameter order (float64, CPU)."""
        params = [p for group in self.param_groups for p in group["params"]]
        return torch.stack([self.state[p]["ratio"].double().cpu() for p in params if "ratio" in self.state[p]])
