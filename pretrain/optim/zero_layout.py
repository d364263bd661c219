"""Where each original parameter lives inside DeepSpeed's flat fp32 partitions (ZeRO-1/2/3, BF16_Optimizer).

DeepSpeed's wrappers hand the client optimizer flat 1-D fp32 tensors, one per (param group, rank) for
ZeRO-1/2 and BF16_Optimizer, one per (sub-group, rank) for ZeRO-3. A `FlatPartition` cuts such a tensor
into pieces: the segments that belong to original parameters (index j inside its group, identical on
every rank) and the gaps (alignment padding, ZeRO-3's uninitialised tail padding) that belong to none.
The attribute map is DeepSpeed 0.19.8's (docs/lamb.md, "DeepSpeed 0.19.8 attributes the binding reads"). Wrappers are
recognised by class name so this module does not import deepspeed (pretrain/engine.py owns that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class UnboundZeroLayoutError(RuntimeError):
    """ExactLamb was asked to step a flat ZeRO partition without knowing its parameter layout."""


@dataclass
class FlatPartition:
    """How one rank's flat fp32 partition splits into parameter segments and padding gaps."""

    piece_sizes: list[int]  # consecutive pieces covering the whole flat tensor
    segment_pieces: list[int]  # indices (into the pieces) of the segments that belong to parameters
    param_indices: list[int]  # per segment: the original parameter's index inside its group
    num_params: int  # parameters in the group / sub-group, on every rank
    process_group: Any  # data-parallel group that holds the other slices of these parameters
    ratio_key: int  # orders trust ratios for logging: group (ZeRO-1/2, BF16) or sub-group (ZeRO-3)
    reduce_device: torch.device | None = (
        None  # where to all-reduce (the accelerator for offloaded CPU partitions)
    )
    # per segment: where it starts inside its parameter's flattened elements (elastic resume copies
    # parameters in and out of partitions with it); empty when the ranges did not say
    param_starts: list[int] = field(default_factory=list)
    _index_cache: dict[tuple[str, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def numel(self) -> int:
        return sum(self.piece_sizes)

    def segments_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` (weights, grads or a moment buffer of the same layout), one per segment."""
        if flat.numel() != self.numel:
            raise UnboundZeroLayoutError(
                f"flat tensor has {flat.numel()} elements but its bound layout covers {self.numel}; "
                "rebind with pretrain.optim.lamb.bind_zero_layout(engine)"
            )
        pieces = flat.split(self.piece_sizes)
        return [pieces[i] for i in self.segment_pieces]

    def all_reduce_sum(self, sums: torch.Tensor) -> torch.Tensor:
        """Sum the per-parameter partial norms over the ranks that hold the other slices."""
        if self.process_group is None or not dist.is_initialized():
            return sums
        if dist.get_world_size(self.process_group) == 1:
            return sums
        # Offloaded partitions live on the CPU; NCCL needs the (tiny) sums on the accelerator.
        on_device = sums.to(self.reduce_device or sums.device)
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=self.process_group)
        return on_device.to(sums.device)

    def param_index_tensor(self, device: torch.device) -> torch.Tensor:
        """Per segment: its parameter's index (param_indices) as a long tensor on `device`."""
        return self._cached_long("param_indices", device)

    def segment_piece_tensor(self, device: torch.device) -> torch.Tensor:
        """segment_pieces as a long tensor on `device` (the fused step scatters per-piece factors with it)."""
        return self._cached_long("segment_pieces", device)

    def piece_size_tensor(self, device: torch.device) -> torch.Tensor:
        """piece_sizes as a long tensor on `device` (the fused step repeats per-piece factors with it)."""
        return self._cached_long("piece_sizes", device)

    def _cached_long(self, name: str, device: torch.device) -> torch.Tensor:
        # The layout never changes once built, so each list crosses to the device once, not every step:
        # `torch.tensor(list, device=cuda)` is a blocking copy plus a stream sync.
        cached = self._index_cache.get((name, device))
        if cached is None:
            cached = torch.tensor(getattr(self, name), dtype=torch.long, device=device)
            self._index_cache[(name, device)] = cached
        return cached


@dataclass
class FlatView:
    """One flat fp32 tensor the client optimizer steps: the parameters it slices (index j = position in
    `params`), the client optimizer's param group it belongs to, and how it is cut."""

    flat: torch.Tensor
    params: list[torch.Tensor]
    group: int
    partition: FlatPartition


@dataclass
class ZeroLayout:
    """All flat partitions of one engine, keyed by id() of the fp32 tensor the optimizer steps."""

    wrapper: str  # class name of the DeepSpeed optimizer wrapper, or "none"
    partitions: dict[int, FlatPartition] = field(default_factory=dict)


def partition_from_ranges(
    flat_numel: int,
    ranges: list[tuple[int, ...]],
    num_params: int,
    process_group: Any,
    ratio_key: int,
    reduce_device: torch.device | None,
) -> FlatPartition:
    """Build a FlatPartition from (param_index, start, length[, start inside the parameter]) ranges local
    to the flat tensor."""
    piece_sizes: list[int] = []
    segment_pieces: list[int] = []
    param_indices: list[int] = []
    param_starts: list[int] = []
    cursor = 0
    for param_index, start, length, *inside in sorted(ranges, key=lambda r: r[1]):
        if length <= 0:
            continue
        if start < cursor or start + length > flat_numel:
            raise ValueError(
                f"ZeRO layout: segment of parameter {param_index} at [{start}, {start + length}) overlaps "
                f"another or leaves the partition of {flat_numel} elements"
            )
        if start > cursor:
            piece_sizes.append(start - cursor)  # padding gap: never read nor written
        segment_pieces.append(len(piece_sizes))
        piece_sizes.append(length)
        param_indices.append(param_index)
        if inside:
            param_starts.append(int(inside[0]))
        cursor = start + length
    if cursor < flat_numel:
        piece_sizes.append(flat_numel - cursor)
    return FlatPartition(
        piece_sizes=piece_sizes,
        segment_pieces=segment_pieces,
        param_indices=param_indices,
        num_params=num_params,
        process_group=process_group,
        ratio_key=ratio_key,
        reduce_device=reduce_device,
        param_starts=param_starts if len(param_starts) == len(param_indices) else [],
    )


def _intersect(
    param_index: int, offset: int, numel: int, start: int, end: int
) -> tuple[int, int, int, int] | None:
    lo, hi = max(offset, start), min(offset + numel, end)
    return (param_index, lo - start, hi - lo, lo - offset) if lo < hi else None


def _reduce_device(flat: torch.Tensor, engine_device: torch.device) -> torch.device | None:
    # ZeRO-Offload keeps partitions on the CPU; NCCL cannot reduce CPU tensors.
    if flat.device.type == "cpu" and engine_device.type != "cpu":
        return engine_device
    return None


def _zero12_views(wrapper: Any, engine_device: torch.device) -> list[FlatView]:
    views = []
    for i, flat in enumerate(wrapper.single_partition_of_fp32_groups):
        group = wrapper.real_dp_process_group[i]
        rank = dist.get_rank(group=group)
        partition_size = int(wrapper.partition_size[i])
        if flat.numel() != partition_size:
            raise UnboundZeroLayoutError(
                f"ZeRO group {i}: fp32 partition {flat.numel()} != partition_size {partition_size}"
            )
        start, end = rank * partition_size, (rank + 1) * partition_size
        original_index = {id(p): j for j, p in enumerate(wrapper.bit16_groups[i])}
        ranges = []
        # The flat buffer follows the round-robin order with its own offsets (equal to the original
        # order unless round_robin_gradients); the index j stays the original one, same on all ranks.
        for param, offset, meta in zip(
            wrapper.round_robin_bit16_groups[i],
            wrapper.round_robin_bit16_offsets[i],
            wrapper.round_robin_bit16_meta[i],
            strict=True,
        ):
            piece = _intersect(original_index[id(param)], int(offset), meta.numel(), start, end)
            if piece is not None:
                ranges.append(piece)
        views.append(FlatView(flat, list(wrapper.bit16_groups[i]), i, partition_from_ranges(
            flat.numel(), ranges, len(original_index), group, i, _reduce_device(flat, engine_device)
        )))
    return views


def _zero3_views(wrapper: Any, engine_device: torch.device) -> list[FlatView]:
    views = []
    for sub_group, params in enumerate(wrapper.fp16_groups):
        flat = wrapper.fp32_partitioned_groups_flat[sub_group]
        group = wrapper.sub_group_process_groups[sub_group]
        rank = dist.get_rank(group=group)
        ranges = []
        for j, param in enumerate(params):
            _, offset, partition_numel = wrapper.grad_position[wrapper.get_param_id(param)]
            # Each parameter is partitioned on its own; the tail of the last owner's slice is
            # uninitialised padding (torch.empty) and must be masked out.
            valid = max(0, min(partition_numel, param.ds_numel - rank * partition_numel))
            if valid:
                ranges.append((j, int(offset), int(valid), rank * int(partition_numel)))
        views.append(FlatView(flat, list(params), int(wrapper.sub_group_to_group_id[sub_group]), partition_from_ranges(
            flat.numel(), ranges, len(params), group, sub_group, _reduce_device(flat, engine_device)
        )))
    return views


def _bf16_views(wrapper: Any, engine_device: torch.device) -> list[FlatView]:
    views = []
    for i, flat in enumerate(wrapper.fp32_groups_flat_partition):
        group = wrapper.real_dp_process_group[i]
        rank = dist.get_rank(group=group)
        partition_size = wrapper.bf16_groups_flat[i].numel() // dist.get_world_size(group=group)
        start, end = rank * partition_size, (rank + 1) * partition_size
        ranges, offset = [], 0
        for j, param in enumerate(wrapper.bf16_groups[i]):  # flattened in original order
            piece = _intersect(j, offset, param.numel(), start, end)
            if piece is not None:
                ranges.append(piece)
            offset += param.numel()
        views.append(FlatView(flat, list(wrapper.bf16_groups[i]), i, partition_from_ranges(
            flat.numel(), ranges, len(wrapper.bf16_groups[i]), group, i, _reduce_device(flat, engine_device)
        )))
    return views


def build_zero_layout(engine: Any, client_optimizer: torch.optim.Optimizer) -> ZeroLayout:
    """Describe every tensor that `engine`'s optimizer wrapper will hand to `client_optimizer.step()`."""
    views = flat_views(engine, client_optimizer)
    if views is None:
        return ZeroLayout(wrapper="none")
    return ZeroLayout(wrapper=type(engine.optimizer).__name__, partitions={id(v.flat): v.partition for v in views})


def flat_views(engine: Any, client_optimizer: torch.optim.Optimizer) -> list[FlatView] | None:
    """Every flat tensor `engine`'s wrapper hands to `client_optimizer.step()`, in the wrapper's order (group
    for ZeRO-1/2 and BF16_Optimizer, sub-group for ZeRO-3); None when there is no wrapper (ZeRO-0)."""
    wrapper = engine.optimizer
    engine_device = (
        torch.device(engine.device) if getattr(engine, "device", None) is not None else torch.device("cpu")
    )
    if wrapper is client_optimizer:
        return None
    if getattr(wrapper, "optimizer", None) is not client_optimizer:
        raise UnboundZeroLayoutError(
            f"engine.optimizer ({type(wrapper).__name__}) does not wrap this ExactLamb instance; was the "
            "engine built with optimizer=<this ExactLamb>?"
        )
    name = type(wrapper).__name__
    if name == "DeepSpeedZeroOptimizer":
        return _zero12_views(wrapper, engine_device)
    if name == "DeepSpeedZeroOptimizer_Stage3":
        if getattr(wrapper, "backup_optimizer", None) is not None:
            raise UnboundZeroLayoutError(
                "ZeRO-3 with a partial optimizer offload ratio steps a second (backup) optimizer; ExactLamb "
                "supports offload_optimizer only with ratio 1.0"
            )
        return _zero3_views(wrapper, engine_device)
    if name == "BF16_Optimizer":
        return _bf16_views(wrapper, engine_device)
    raise UnboundZeroLayoutError(
        f"ExactLamb does not know the layout of DeepSpeed's {name} optimizer wrapper; supported: no wrapper "
        "(fp32, ZeRO-0), ZeRO stages 1-3, BF16_Optimizer. For fp16/bf16 use ZeRO stage >= 1."
    )
