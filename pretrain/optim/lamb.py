"""ExactLamb: LAMB (You et al., ICLR 2020) with per-parameter trust ratios, exact under DeepSpeed ZeRO.

Its name is ExactLamb everywhere: `"type": "ExactLamb"` in a DeepSpeed JSON, the Python class
`pretrain.optim.lamb.ExactLamb`, the docs and every message.

The math is the paper's, per original parameter tensor:

    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
    m_hat = m / (1 - b1^t);  v_hat = v / (1 - b2^t)          (when bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + wd * w
    ratio = ||w|| / ||u||   (1 when either norm is 0; optionally clamped to trust_clip;
                             1 for weight-decay-0 groups unless adapt_all, see lamb_math.adapts)
    w -= lr * ratio * u

The math runs as multi-tensor `torch._foreach_*` kernels over a list of "pieces" (on CPU tensors the
direction is written into reusable scratch buffers instead of fresh temporaries). Without ZeRO a
piece is a whole parameter. Under ZeRO (and DeepSpeed's BF16_Optimizer) the optimizer only sees flat
fp32 partitions; after `bind_zero_layout(engine)` each partition is cut into the slices that belong
to original parameters (padding belongs to none and is never read or written), the squared norms
of each slice are summed per parameter across the data-parallel group with one small all-reduce,
and every slice gets its own parameter's ratio. See pretrain/optim/zero_layout.py for the layout.

No gradient clipping happens here: DeepSpeed's global-norm "gradient_clipping" runs before step().
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pretrain.optim.fused_lamb import FusedKernels, fused_available, fused_flat_step
from pretrain.optim.lamb_math import adapts, apply_update, lamb_direction, squared_norms, trust_ratios
from pretrain.optim.unwrap import OptimizerMetrics
from pretrain.optim.zero_layout import (
    FlatPartition,
    UnboundZeroLayoutError,
    ZeroLayout,
    build_zero_layout,
    flat_views,
)

__all__ = [
    "ExactLamb",
    "UnboundZeroLayoutError",
    "bind_zero_layout",
    "weight_decay_param_groups",
]

# Module types whose every parameter is a normalisation scale/shift: never weight-decayed.
_NORM_MODULE_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,
)


def weight_decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two param groups: decayed weights, and biases + normalisation parameters with weight_decay 0.

    The choice is by module type (a norm layer's parameters, any module's registered `bias`), not by
    parameter-name patterns. Tied parameters appear once. Empty groups are dropped, because ZeRO
    flattens per group and an empty group would be an empty flat buffer.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, _NORM_MODULE_TYPES):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter):
            no_decay_ids.add(id(bias))
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for param in model.parameters():  # model.parameters() already skips tied duplicates
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if id(param) in no_decay_ids else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


class ExactLamb(torch.optim.Optimizer):
    """ExactLamb: paper-exact LAMB with per-parameter trust ratios; see the module docstring."""

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
        scratch_buffers: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        """adapt_all: False (default, as apex FusedLAMB, TF-Addons and the MLPerf reference): no trust ratio
        for groups with weight_decay 0 (biases, LayerNorm), which then take the plain Adam-style step
        lr * u; True: every tensor gets one (the paper's algorithm read literally), which keeps
        zero-initialised biases near 0 for as long as lr is small (docs/lamb.md, "adapt_all").

        scratch_buffers: keep one reusable buffer per tensor for the update direction and apply it
        with one in-place pass per tensor (None = on CPU tensors only, where fresh allocations page-fault;
        False = multi-tensor kernels with temporaries throughout, the accelerator path).

        fused: step ZeRO/bf16 flat partitions with the two torch.compile'd kernels of
        pretrain/optim/fused_lamb.py (None = on CUDA tensors, falling back to uncompiled flat math if
        compiling fails; True = always, errors raised; False = the reference multi-tensor step).
        Parameters stepped as separate tensors (no ZeRO) always take the reference step."""
        if not lr >= 0.0:
            raise ValueError(f"ExactLamb: lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"ExactLamb: betas must be two values in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"ExactLamb: eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"ExactLamb: weight_decay must be >= 0, got {weight_decay}")
        if trust_clip is not None:
            trust_clip = _validated_trust_clip(trust_clip)
        defaults = dict(
            lr=lr,
            betas=(float(betas[0]), float(betas[1])),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bool(bias_correction),
            trust_clip=trust_clip,
            adapt_all=bool(adapt_all),
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["trust_clip"] is not None:
                group["trust_clip"] = _validated_trust_clip(group["trust_clip"])
        # Tensors this optimizer was built on: stepping them per tensor is exact. Anything else it is
        # asked to step (a ZeRO flat partition) must be described by a bound layout.
        self._constructed_ids: set[int] = {id(p) for g in self.param_groups for p in g["params"]}
        self._layout: ZeroLayout | None = None
        self._engine_ref: Callable[[], Any] | None = None
        self._last_ratios: dict[tuple[str, int], torch.Tensor] = {}
        self._adapted_keys: set[tuple[str, int]] = set()  # the entries of _last_ratios whose group adapts
        # CPU scratch buffers for the update direction, keyed by id(); not optimizer state.
        self._scratch: dict[int, torch.Tensor] = {}
        self._scratch_mode = scratch_buffers
        if fused not in (None, True, False):
            raise ValueError(f"ExactLamb: fused must be null, true or false, got {fused!r}")
        self._fused_mode = fused
        self._fused_kernels: FusedKernels | None = None

    # ------------------------------------------------------------------ binding
    def bind(self, engine: Any) -> None:
        """Attach the flat-partition layout of `engine` (a DeepSpeedEngine); see bind_zero_layout.

        Also creates every flat partition's state (zero moments, step 0) now instead of at its first step:
        ZeRO-1/2 link DeepSpeed's per-parameter views of the optimizer state (`safe_get_full_optimizer_state`,
        used by elastic resume checks and universal checkpoints) once, right after the *first* group's
        step, so a group whose state did not exist yet would stay unreadable through them for good.
        """
        self._layout = build_zero_layout(engine, self)
        self._engine_ref = weakref.ref(engine)
        self._scratch.clear()  # the flat tensors they shadowed may be gone
        for view in flat_views(engine, self) or []:
            if not self.state[view.flat]:
                self._new_flat_state(view.flat)

    def set_zero_layout(self, layout: ZeroLayout | None) -> None:
        """Use a layout built elsewhere (benchmarks, other wrappers); no automatic rebinding."""
        self._layout = layout
        self._engine_ref = None
        self._scratch.clear()

    @property
    def zero_layout(self) -> ZeroLayout | None:
        return self._layout

    # ------------------------------------------------------------------ logging
    def last_trust_ratios(self, adapted_only: bool = False) -> torch.Tensor | None:
        """Trust ratio of every original parameter at the last step (group order, then param order);
        `adapted_only`: of the groups that get one (`adapts`), without the 1s of the others, which would
        pull a logged min/mean towards 1 (biases and LayerNorm under the default adapt_all=False)."""
        keys = sorted(key for key in self._last_ratios if not adapted_only or key in self._adapted_keys)
        if not keys:
            return None
        return torch.cat([self._last_ratios[key].float() for key in keys]).cpu()

    def trust_ratio_stats(self) -> dict[str, float]:
        """min / mean / max of the adapted tensors' trust ratios at the last step (one host read)."""
        ratios = self.last_trust_ratios(adapted_only=True)
        if ratios is None or ratios.numel() == 0:
            return {}
        low, mean, high = torch.stack([ratios.min(), ratios.mean(), ratios.max()]).tolist()
        return {"min": low, "mean": mean, "max": high}

    def step_metrics(self) -> OptimizerMetrics:
        """What the trainer logs of the last step (pretrain/metrics/optimizer_report.py): min / mean / max of the
        adapted tensors' trust ratios as lamb/trust_ratio_*, and all of them as the lamb/trust_ratio histogram."""
        ratios = self.last_trust_ratios(adapted_only=True)
        if ratios is None:
            return OptimizerMetrics()
        scalars = {f"lamb/trust_ratio_{name}": value for name, value in self.trust_ratio_stats().items()}
        return OptimizerMetrics(scalars, {"lamb/trust_ratio": ratios})

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            with_grad = [p for p in group["params"] if p.grad is not None]
            own = [p for p in with_grad if id(p) in self._constructed_ids]
            flats = [p for p in with_grad if id(p) not in self._constructed_ids]
            if own:
                self._step_own_params(group, group_index, own)
            for flat in flats:
                self._step_flat_partition(group, self._partition_for(flat), flat)
        return loss

    def _partition_for(self, flat: torch.Tensor) -> FlatPartition:
        partition = self._layout.partitions.get(id(flat)) if self._layout is not None else None
        if partition is None and self._engine_ref is not None:
            # The wrapper re-created its flat tensors (checkpoint load, offload reload): rebind once.
            engine = self._engine_ref()
            if engine is not None:
                self.bind(engine)
                partition = self._layout.partitions.get(id(flat)) if self._layout is not None else None
        if partition is None:
            raise UnboundZeroLayoutError(
                f"ExactLamb was asked to step a tensor of shape {tuple(flat.shape)} that is not one of the "
                "parameters it was built on: a DeepSpeed ZeRO/bf16 flat partition. Per-layer trust ratios "
                "would be wrong. Call pretrain.optim.lamb.bind_zero_layout(engine) once after "
                "deepspeed.initialize (pretrain.engine.build_engine does this for you)."
            )
        return partition

    def _new_flat_state(self, flat: torch.Tensor) -> dict[str, Any]:
        """Padding's moments stay zero forever: only segment views are ever written."""
        state = self.state[flat]
        state.update(step=0, exp_avg=torch.zeros_like(flat), exp_avg_sq=torch.zeros_like(flat))
        return state

    def _scratch_for(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A reusable buffer shaped like `tensor` on the CPU (page-faulting a fresh one each step costs
        more than the math); None on accelerators, whose caching allocator makes temporaries free."""
        wanted = self._scratch_mode if self._scratch_mode is not None else tensor.device.type == "cpu"
        if not wanted:
            return None
        buffer = self._scratch.get(id(tensor))
        if buffer is None or (buffer.shape, buffer.dtype, buffer.device) != (
            tensor.shape,
            tensor.dtype,
            tensor.device,
        ):
            buffer = torch.empty_like(tensor)
            self._scratch[id(tensor)] = buffer
        return buffer

    def _step_own_params(self, group: dict[str, Any], group_index: int, params: list[torch.Tensor]) -> None:
        steps = []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            steps.append(state["step"])
        scratch = [self._scratch_for(p) for p in params]
        direction, scales = lamb_direction(
            group,
            weights=params,
            grads=[p.grad for p in params],
            exp_avgs=[self.state[p]["exp_avg"] for p in params],
            exp_avg_sqs=[self.state[p]["exp_avg_sq"] for p in params],
            steps=steps,
            scratch=None if scratch[0] is None else scratch,
        )
        if adapts(group):
            w_sq, u_sq = squared_norms(params, direction, scales)
            ratios = trust_ratios(w_sq, u_sq, group["trust_clip"])
        else:
            ratios = torch.ones(len(params), dtype=torch.float64, device=params[0].device)
        apply_update(params, direction, scales, ratios, group["lr"], in_place=scratch[0] is not None)
        self._last_ratios[("a", group_index)] = ratios
        self._note_adapted(("a", group_index), group)

    def _step_flat_partition(
        self, group: dict[str, Any], partition: FlatPartition, flat: torch.Tensor
    ) -> None:
        state = self.state[flat] if self.state[flat] else self._new_flat_state(flat)
        state["step"] += 1
        if flat.grad is None or flat.grad.numel() != flat.numel():
            raise RuntimeError(
                f"ExactLamb: flat partition of {flat.numel()} elements has no matching gradient"
            )
        if self._fused_mode or (self._fused_mode is None and fused_available(flat.device)):
            if self._fused_kernels is None:
                self._fused_kernels = FusedKernels(compiled=True, strict=self._fused_mode is True)
            self._last_ratios[("b", partition.ratio_key)] = fused_flat_step(
                self._fused_kernels, group, partition, flat, state, adapts(group), squared_norms, trust_ratios
            )
            self._note_adapted(("b", partition.ratio_key), group)
            return
        weights = partition.segments_of(flat)
        scratch = self._scratch_for(flat)
        direction, scales = lamb_direction(
            group,
            weights=weights,
            grads=partition.segments_of(flat.grad),
            exp_avgs=partition.segments_of(state["exp_avg"]),
            exp_avg_sqs=partition.segments_of(state["exp_avg_sq"]),
            steps=[state["step"]] * len(weights),
            scratch=None if scratch is None else partition.segments_of(scratch),
        )
        if adapts(group):
            sums = torch.zeros(2, partition.num_params, dtype=torch.float64, device=flat.device)
            if weights:
                w_sq, u_sq = squared_norms(weights, direction, scales)
                index = partition.param_index_tensor(flat.device)
                sums[0].index_add_(0, index, w_sq)
                sums[1].index_add_(0, index, u_sq)
            sums = partition.all_reduce_sum(sums)
            param_ratios = trust_ratios(sums[0], sums[1], group["trust_clip"])
            ratios = param_ratios[partition.param_index_tensor(flat.device)] if weights else param_ratios[:0]
        else:
            param_ratios = torch.ones(partition.num_params, dtype=torch.float64, device=flat.device)
            ratios = param_ratios[: len(weights)]
        if weights:
            apply_update(weights, direction, scales, ratios, group["lr"], in_place=scratch is not None)
        self._last_ratios[("b", partition.ratio_key)] = param_ratios
        self._note_adapted(("b", partition.ratio_key), group)

    def _note_adapted(self, key: tuple[str, int], group: dict[str, Any]) -> None:
        if adapts(group):
            self._adapted_keys.add(key)
        else:
            self._adapted_keys.discard(key)


def bind_zero_layout(engine: Any) -> ExactLamb:
    """Bind the ExactLamb behind `engine` to its ZeRO flat-partition layout; returns it.

    Call once after `deepspeed.initialize` when not using pretrain.engine.build_engine. The binding
    is refreshed automatically when the wrapper re-creates its partitions (e.g. checkpoint load).
    """
    optimizer = getattr(engine, "basic_optimizer", None)
    if not isinstance(optimizer, ExactLamb):
        raise TypeError(
            f"bind_zero_layout: the engine's client optimizer is {type(optimizer).__name__}, not "
            "pretrain.optim.lamb.ExactLamb; pass `optimizer=ExactLamb(...)` to deepspeed.initialize"
        )
    optimizer.bind(engine)
    return optimizer


# ---------------------------------------------------------------------- kernels
def _validated_trust_clip(trust_clip: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in trust_clip)
    except (TypeError, ValueError) as error:
        raise ValueError(f"ExactLamb: trust_clip must be null or [lo, hi], got {trust_clip!r}") from error
    if not 0.0 <= lo <= hi:
        raise ValueError(f"ExactLamb: trust_clip needs 0 <= lo <= hi, got {trust_clip!r}")
    return (lo, hi)
