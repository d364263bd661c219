"""The gradient norm of each layer group before clipping, at every ZeRO stage: a step monitor
(pretrain/metrics/monitor_contract.py). Which layers' gradients grow or vanish, where the global grad_norm says only
that something did.

Where the gradients are. Without an optimizer wrapper (ZeRO-0 in fp32) they are the model's own, averaged over
the ranks by the boundary backward and not yet clipped: `before_step` sums their squares per group. Under a
wrapper (ZeRO-1/2/3, BF16_Optimizer) they exist only inside its step, as flat fp32 partitions, one slice per
rank, handed to the client optimizer already unscaled and clipped: a step pre-hook on the client optimizer
sums the squares of each partition's parameter segments per group (pretrain/optim/zero_layout.py says which
slice is which parameter; padding belongs to none). This rank's sums are the squares of its slices only, so
they are all-reduced over the partitions' data-parallel group, the way the wrapper reduces the global norm;
the clipping scaled every gradient by one factor, max(1, (norm + 1e-6) / clip) with the global norm before
clipping, which the monitor undoes.

Costs: the hook and `before_step` queue device work only (one multi-tensor norm per partition, an index_add);
the all-reduce (one per process group, usually one) and the one host read happen in `values`, for a logged
step, after the step's own host read. A wrapper whose layout is not known (fp16 without ZeRO) logs no groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.optim.unwrap import client_optimizer
from pretrain.optim.zero_layout import FlatPartition, FlatView, UnboundZeroLayoutError, flat_views
from pretrain.step_stats import StepResult

CLIP_EPS = 1e-6  # DeepSpeed's clip factor: (norm + 1e-6) / clip, applied when above 1 (ZeRO-1/2/3, BF16, ZeRO-0)


def layer_group(name: str) -> str:
    """A parameter's group by its name in the model: `embeddings`, `layer_NN` for encoder layer NN (transformers'
    `encoder.layer.N`), else `head` (the pooler, the MLM and NSP heads)."""
    parts = name.split(".")
    if "embeddings" in parts:
        return "embeddings"
    for part, after in zip(parts, parts[1:], strict=False):
        if part == "layer" and after.isdigit():
            return f"layer_{int(after):02d}"
    return "head"


class GroupGradNorms(StepMonitor):
    """The gradient norm before clipping of each layer group: the groups' squares add up to grad_norm's.

    Tags:
        grad_norm/embeddings  the embeddings' gradient norm (the word embeddings are tied to the MLM decoder)
        grad_norm/layer_<NN>  encoder layer NN's gradient norm (layer_00 is the first)
        grad_norm/head        the pooler's and the pretraining heads' gradient norm
    """

    def __init__(self, group_of: Callable[[str], str] = layer_group) -> None:
        self.group_of = group_of  # a parameter's name in the model -> its group
        self.groups: list[str] = []  # in the model's order; none: nothing to log (not attached, layout unknown)
        self.engine: Any = None
        self.unwrapped = False  # no optimizer wrapper: the model's own gradients, whole on every rank
        self._hook: Any = None
        self._whole: torch.Tensor | None = None  # unwrapped: the step's squares per group
        self._sums: dict[int, torch.Tensor] = {}  # wrapped, by process group (id): this rank's slices' squares
        self._views: dict[int, FlatView] = {}
        self._reducers: dict[int, FlatPartition] = {}  # one partition per process group, to all-reduce with
        self._index: dict[Any, torch.Tensor] = {}  # segment (or parameter) -> group, on the device

    def attach(self, engine: Any) -> None:
        self.close()
        self.engine, self.client = engine, client_optimizer(engine)
        named = list(engine.module.named_parameters())
        self.groups = list(dict.fromkeys(self.group_of(name) for name, _ in named))
        self._group_of = {id(p): self.groups.index(self.group_of(name)) for name, p in named}
        self._params = [p for _, p in named]
        self.unwrapped = engine.optimizer is self.client
        try:
            self._bind()
        except UnboundZeroLayoutError:
            self.groups = []  # a wrapper whose layout we do not know: no groups logged
            return
        if not self.unwrapped:
            self._hook = self.client.register_step_pre_hook(self._before_optimizer_step)

    def _bind(self) -> None:
        """The wrapper's flat partitions by tensor, and one partition per process group, in the wrapper's order
        (the same on every rank: `values` all-reduces in it)."""
        views = flat_views(self.engine, self.client) or []
        self._views = {id(view.flat): view for view in views}
        self._reducers = {}
        for view in views:
            self._reducers.setdefault(id(view.partition.process_group), view.partition)
        self._index = {}  # a tensor made anew may reuse an old one's id

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def before_step(self) -> None:
        self._whole, self._sums = None, {}
        if not self.unwrapped or not self.groups:
            return
        present = [i for i, p in enumerate(self._params) if p.grad is not None]
        if present:
            norms = torch.stack(torch._foreach_norm([self._params[i].grad for i in present], 2,
                                                    dtype=torch.float32))
            where = self._cached_index(tuple(present), [self._group_of[id(self._params[i])] for i in present],
                                       norms.device)
            self._whole = self._zeros(norms.device).index_add_(0, where, norms.double().square())

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The client optimizer's step pre-hook: the squares of this rank's slices, per group (no host read)."""
        for param_group in optimizer.param_groups:
            for flat in param_group["params"]:
                if flat.grad is None:
                    continue
                if id(flat) not in self._views:  # partitions made anew (a reloaded engine): read the layout again
                    self._bind()
                view = self._views.get(id(flat))
                if view is None:
                    continue
                segments = view.partition.segments_of(flat.grad.detach())
                if not segments:
                    continue
                norms = torch.stack(torch._foreach_norm(segments, 2, dtype=torch.float32))
                groups = [self._group_of[id(view.params[j])] for j in view.partition.param_indices]
                where = self._cached_index(id(flat), groups, norms.device)
                key = id(view.partition.process_group)
                sums = self._sums.get(key)
                if sums is None:
                    sums = self._sums[key] = self._zeros(norms.device)
                sums.index_add_(0, where, norms.double().square().to(sums.device))

    def _zeros(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(len(self.groups), dtype=torch.float64, device=device)

    def _cached_index(self, key: Any, groups: list[int], device: torch.device) -> torch.Tensor:
        # a layout never changes once built: each index crosses to the device once, not every step
        # (`torch.tensor(list, device=cuda)` is a blocking copy)
        cached = self._index.get(key)
        if cached is None:
            cached = self._index[key] = torch.tensor(groups, dtype=torch.long, device=device)
        return cached

    def values(self, result: StepResult) -> dict[str, float]:
        if not self.groups or not result.applied:  # a skipped step (overflow) ran no optimizer step
            return {}
        if self.unwrapped:
            squares = self._whole  # whole on every rank: nothing to add up, and read before the clipping
        else:
            squares = None
            for key, partition in self._reducers.items():  # every rank: the same groups, in the same order
                local = self._sums.get(key)
                if local is None:
                    local = self._zeros(partition.reduce_device or self._device())
                total = partition.all_reduce_sum(local)
                squares = total if squares is None else squares + total.to(squares.device)
            if squares is not None:
                squares = squares * self._unclip_factor(squares.device) ** 2
        self._whole, self._sums = None, {}
        if squares is None:
            return {}
        norms = squares.sqrt().tolist()  # the one host read
        return {f"grad_norm/{group}": norm for group, norm in zip(self.groups, norms, strict=True)}

    def _device(self) -> torch.device:
        return torch.device(self.engine.device) if getattr(self.engine, "device", None) is not None else \
            torch.device("cpu")

    def _unclip_factor(self, device: torch.device) -> torch.Tensor | float:
        """What the wrapper divided the gradients by when it clipped them (1: not clipped)."""
        clip = float(self.engine.gradient_clipping() or 0.0)
        norm = self.engine.get_global_grad_norm()
        if clip <= 0 or norm is None:
            return 1.0
        norm = torch.as_tensor(norm, dtype=torch.float64).to(device)
        return ((norm + CLIP_EPS) / clip).clamp(min=1.0)
