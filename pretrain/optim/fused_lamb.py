"""Fused LAMB step for one flat ZeRO / bf16 partition: two compiled kernels instead of ~10 passes.

The reference step in pretrain/optim/lamb.py runs multi-tensor `torch._foreach_*` ops over the segment
views of a flat partition: each op is one pass over memory, ~10 passes in all. Here the same math
runs on the whole flat tensor as two `torch.compile`d functions (Triton on CUDA, C++/OpenMP on CPU):

    1. moments + direction   reads w, g, m, v; writes m, v, d         d = m / (sqrt(v) + eps*sqrt(bc2)) + wd/c * w
    2. apply                 reads w, d, one factor per piece; writes w      w += (-lr * ratio * c) * d

and between them the per-parameter squared norms of w and d come from one multi-tensor norm over
the segment views plus the partition's usual all-reduce (the reference code, shared). That is
~52 bytes of memory traffic per fp32 element against ~40 for the ideal single pass.

Differences from the reference, all documented tolerances of tests/optim/test_fused_lamb.py:
- fp32 rounding: the scalar factor is applied in fp32 (reference: a float64 Python scalar) and the
  moment update is fused, so weights agree to rtol 1e-5 / atol 1e-7 over several steps.
- padding gaps of the flat tensor: their moments follow whatever the gradient holds there (ZeRO keeps
  it zero), their weights are never changed (factor 0). The reference never touches gaps at all.

Scalars that change every step (bias corrections, lr) enter as 0-d tensors and sizes are symbolic,
so the kernels compile once per process, not once per step or per partition. Nothing crosses from
the host to the device per step: the 0-d scalars are the same cached tensors refilled with `fill_`,
the layout's index tensors are cached per partition (pretrain/optim/zero_layout.py).

Precision: the math runs in fp32 (the flat's dtype if wider) whatever the flat's dtype, with fp32
scalars, and only the stored results (moments, weights) are rounded to the flat's dtype. A scalar
cast to the flat's dtype would be wrong in bf16: beta2 = 0.999 rounds to 1.0 (v would never decay),
1 - beta1 = 0.1 to 0.10009766, lr x ratio x c off by up to 0.4%. This is correct and free: the fp32
partitions DeepSpeed hands over (ZeRO, BF16_Optimizer) take exactly the old path (every upcast is a
no-op), and for a low-precision flat (`bf16_master_weights_and_grads`) the compiled kernels upcast in
registers anyway (inductor computes bf16 in fp32), so the memory traffic is unchanged apart from the
direction d, kept in fp32 so the trust-ratio norms and the update see it unrounded. Refusing such
flats instead would reject a DeepSpeed configuration the reference step accepts; what stays inherent
to it is the storage: a bf16 moment or weight cannot hold a change below half its ulp (~0.2%), in
this step and in the reference alike.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pretrain.optim.zero_layout import FlatPartition

Kernel = Callable[..., Any]


def _moments_and_direction(
    w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    one_minus_beta1: torch.Tensor, beta2: torch.Tensor, one_minus_beta2: torch.Tensor, eps_t: torch.Tensor,
    wd_over_c: torch.Tensor,
) -> torch.Tensor:
    # 1 - beta comes from the host in float64: 1 - 0.999 rounded in fp32 is off by 5e-5 relative.
    # The scalars carry the compute dtype; `.to` returns the tensor itself when it already has it (fp32).
    compute = beta2.dtype
    g_c, m_c, v_c = g.to(compute), m.to(compute), v.to(compute)
    m_c.lerp_(g_c, one_minus_beta1)
    v_c.mul_(beta2).addcmul_(g_c, g_c * one_minus_beta2)
    if m.dtype != compute:  # low-precision state: one rounding on store
        m.copy_(m_c)
        v.copy_(v_c)
    return m_c / (v_c.sqrt() + eps_t) + wd_over_c * w.to(compute)


def _apply(w: torch.Tensor, d: torch.Tensor, piece_factors: torch.Tensor, piece_sizes: torch.Tensor) -> None:
    factors = torch.repeat_interleave(piece_factors, piece_sizes, output_size=w.numel())
    if w.dtype == d.dtype:
        w.add_(d * factors)
    else:  # low-precision weights: add in the compute dtype, one rounding on store (gaps: factor 0, exact)
        w.copy_(w.to(d.dtype) + d * factors)


class FusedKernels:
    """The two step functions, compiled lazily; falls back to eager (same math) when compiling fails
    and `strict` is False (auto mode), so a machine without a compiler still trains."""

    def __init__(self, compiled: bool, strict: bool) -> None:
        self.compiled, self.strict = compiled, strict
        self.direction: Kernel = _moments_and_direction
        self.apply: Kernel = _apply
        self._scalars: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
        if compiled:
            # dynamic: one graph serves every partition size (groups, models), no recompiles per shape
            self.direction = torch.compile(_moments_and_direction, dynamic=True, fullgraph=True)
            self.apply = torch.compile(_apply, dynamic=True)

    def scalars(self, device: torch.device, dtype: torch.dtype, values: tuple[float, ...]) -> list[torch.Tensor]:
        """`values` as 0-d tensors on `device`, the same tensors every step, refilled in place.

        `torch.tensor(x, device=cuda)` is a blocking host->device copy plus a stream sync; `fill_` with a
        Python scalar is one kernel launch that carries the value, queued behind the previous step's use.
        """
        key = (device, dtype, len(values))
        cached = self._scalars.get(key)
        if cached is None:
            cached = [torch.zeros((), dtype=dtype, device=device) for _ in values]
            self._scalars[key] = cached
        for tensor, value in zip(cached, values, strict=True):
            tensor.fill_(value)
        return cached

    def call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self, name)(*args)
        except Exception as error:  # inductor/triton/compiler errors have no common base class
            if not self.compiled or self.strict:
                raise
            warnings.warn(f"fused LAMB: torch.compile failed ({type(error).__name__}: {error}); "
                          "using the same flat math uncompiled", RuntimeWarning, stacklevel=2)
            self.compiled = False
            self.direction, self.apply = _moments_and_direction, _apply
            return getattr(self, name)(*args)


def fused_flat_step(
    kernels: FusedKernels,
    group: dict[str, Any],
    partition: FlatPartition,
    flat: torch.Tensor,
    state: dict[str, Any],
    adapts: bool,
    squared_norms: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    trust_ratios: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """One LAMB step of `flat` in place; returns the per-parameter trust ratios (float64)."""
    beta1, beta2 = group["betas"]
    step = state["step"]
    if group["bias_correction"]:
        bc2_sqrt = math.sqrt(1.0 - beta2**step)
        c, eps_t = bc2_sqrt / (1.0 - beta1**step), group["eps"] * bc2_sqrt
    else:
        c, eps_t = 1.0, group["eps"]
    device = flat.device
    compute = torch.promote_types(flat.dtype, torch.float32)  # see "Precision" in the module docstring

    scalars = kernels.scalars(device, compute, (1.0 - beta1, beta2, 1.0 - beta2, eps_t, group["weight_decay"] / c))
    d = kernels.call("direction", flat, flat.grad, state["exp_avg"], state["exp_avg_sq"], *scalars)
    weights = partition.segments_of(flat)
    if adapts:
        sums = torch.zeros(2, partition.num_params, dtype=torch.float64, device=device)
        if weights:
            w_sq, u_sq = squared_norms(weights, partition.segments_of(d), [c] * len(weights))
            index = partition.param_index_tensor(device)
            sums[0].index_add_(0, index, w_sq)
            sums[1].index_add_(0, index, u_sq)
        sums = partition.all_reduce_sum(sums)
        param_ratios = trust_ratios(sums[0], sums[1], group["trust_clip"])
    else:
        param_ratios = torch.ones(partition.num_params, dtype=torch.float64, device=device)
    if weights:
        piece_factors = torch.zeros(len(partition.piece_sizes), dtype=torch.float64, device=device)
        piece_factors[partition.segment_piece_tensor(device)] = (
            param_ratios[partition.param_index_tensor(device)] * (-float(group["lr"]) * c)
        )
        kernels.call("apply", flat, d, piece_factors.to(compute), partition.piece_size_tensor(device))
    return param_ratios


def fused_available(device: torch.device) -> bool:
    """Auto mode turns the compiled path on for CUDA tensors only (Triton ships with CUDA PyTorch)."""
    return device.type == "cuda" and hasattr(torch, "compile")
