"""The LAMB math as multi-tensor kernels over lists of "pieces" (whole parameters, or the slices of a
ZeRO flat partition that belong to one parameter); pretrain/optim/lamb.py decides what the pieces are.

    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
    u = m_hat / (sqrt(v_hat) + eps) + wd * w = c * d     (lamb_direction: d and the scalar c per piece)
    ratio = ||w|| / ||u||                                   (squared_norms -> trust_ratios, after the
                                                             caller sums the norms of a parameter's pieces)
    w -= lr * ratio * u                                     (apply_update)
"""

from __future__ import annotations

import math
from typing import Any

import torch


def adapts(group: dict[str, Any]) -> bool:
    """Whether `group` gets trust ratios: always when weight decay is on; with weight decay 0 (biases,
    LayerNorm) only under adapt_all=True.

    adapt_all=False (the default) is apex FusedLAMB's use_nvlamb=False and TF-Addons' / the MLPerf
    reference's exclude_from_layer_adaptation. With a ratio, a zero-initialised bias can grow only by a
    factor (1 + lr) per step once it is non-zero (ratio = ||b|| / ||u||), so it stays ~0 through warm-up.
    """
    return bool(group["adapt_all"]) or group["weight_decay"] != 0


def lamb_direction(
    group: dict[str, Any],
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[int],
    scratch: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[float]]:
    """Advance the Adam moments in place; return (d, c) with the update direction u_i = c_i * d_i.

    m_hat / (sqrt(v_hat) + eps) + wd*w == c * (m / (sqrt(v) + eps*sqrt(bc2)) + (wd/c) * w) with
    c = sqrt(bc2) / bc1: bias correction becomes one scalar per tensor instead of two passes over memory,
    and the trust ratio and the final update absorb c for free. `scratch` (CPU) receives d in place.
    """
    if not weights:
        return [], []
    beta1, beta2 = group["betas"]
    eps, weight_decay = group["eps"], group["weight_decay"]
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)  # m = b1*m + (1-b1)*g in one pass
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    direction: list[torch.Tensor] = list(weights)  # placeholders, replaced below
    scales = [1.0] * len(weights)
    # Tensors of one group almost always share the step count; bucket them so each op takes scalars.
    buckets: dict[int, list[int]] = {}
    for i, t in enumerate(steps):
        buckets.setdefault(t, []).append(i)
    for t, idx in buckets.items():
        if group["bias_correction"]:
            bc2_sqrt = math.sqrt(1.0 - beta2**t)
            c, eps_t = bc2_sqrt / (1.0 - beta1**t), eps * bc2_sqrt
        else:
            c, eps_t = 1.0, eps
        m_b, v_b = [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx]
        if scratch is None:
            d_b = torch._foreach_sqrt(v_b)
            torch._foreach_add_(d_b, eps_t)
            d_b = torch._foreach_div(m_b, d_b)
        else:
            d_b = [scratch[i] for i in idx]
            for d, v in zip(d_b, v_b, strict=True):
                torch.sqrt(v, out=d)
            torch._foreach_add_(d_b, eps_t)
            for d, m in zip(d_b, m_b, strict=True):
                torch.div(m, d, out=d)
        if weight_decay != 0:
            torch._foreach_add_(d_b, [weights[i] for i in idx], alpha=weight_decay / c)
        for i, d in zip(idx, d_b, strict=True):
            direction[i], scales[i] = d, c
    return direction, scales


def squared_norms(
    weights: list[torch.Tensor], direction: list[torch.Tensor], scales: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared L2 norms of each weight and of each update u = c * d, as float64 vectors.

    The norms are returned in at least fp32: `_foreach_norm` of bf16 tensors would round each norm to
    bf16 (0.4%), and the trust ratio with it.
    """
    w_norms = torch.stack(torch._foreach_norm(weights, 2, dtype=_norm_dtype(weights))).double()
    u_norms = torch.stack(torch._foreach_norm(direction, 2, dtype=_norm_dtype(direction))).double()
    u_norms = _scaled(u_norms, scales)
    return w_norms * w_norms, u_norms * u_norms


def _scaled(values: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """values * scales without a host->device copy in the usual case (one scale: every piece shares the
    step count); `torch.tensor(list, device=cuda)` would be a blocking copy plus a stream sync."""
    if len(set(scales)) <= 1:
        return values * (scales[0] if scales else 1.0)
    return values * torch.tensor(scales, dtype=torch.float64).to(values.device, non_blocking=True)


def _norm_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """fp32, or fp64 when the list holds fp64 tensors (never narrower than the inputs)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def trust_ratios(
    w_sq: torch.Tensor, u_sq: torch.Tensor, trust_clip: tuple[float, float] | None
) -> torch.Tensor:
    w_norm, u_norm = w_sq.sqrt(), u_sq.sqrt()
    ratios = torch.where(
        (w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-300), torch.ones_like(w_norm)
    )
    if trust_clip is not None:
        ratios = ratios.clamp(trust_clip[0], trust_clip[1])
    return ratios


def apply_update(
    weights: list[torch.Tensor],
    direction: list[torch.Tensor],
    scales: list[float],
    ratios: torch.Tensor,
    lr: float,
    in_place: bool,
) -> None:
    """w -= lr * ratio * c * d, one scalar per tensor (one host sync for the whole list)."""
    lr_neg = -float(lr)
    factors = [ratio * scale * lr_neg for ratio, scale in zip(ratios.double().cpu().tolist(), scales, strict=True)]
    if in_place:
        for w, d, f in zip(weights, direction, factors, strict=True):
            w.add_(d, alpha=f)  # one pass per tensor (CPU foreach kernels loop per tensor anyway)
    else:
        torch._foreach_mul_(direction, factors)
        torch._foreach_add_(weights, direction)
