"""The engine config the check builds for a recipe phase (also the preflight's check) and the LAMB-step rows
of bench/gpu_check/run.py (see its docstring); the training rows are in bench/gpu_check/train.py."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pretrain.config.deepspeed import phase_ds_config
from pretrain.config.load import load_config
from pretrain.model.bert import bert_config, build_model
from pretrain.optim.lamb import ExactLamb, weight_decay_param_groups
from pretrain.optim.zero_layout import ZeroLayout, partition_from_ranges

LAMB_FLOOR_BYTES_PER_PARAM = 40


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_config(recipe: Path, phase: str, micro: int, world_size: int, ds_config: Path | None = None,
                  bf16_supported: bool = True, accumulation: int = 1) -> dict[str, Any]:
    """What the driver builds for `phase` of the shipped `recipe` (its DeepSpeed JSON: grad_accum_dtype fp32,
    ZeRO-1, ExactLamb, clipping 1.0; its lr; run.precision), through the driver's own config code, with only
    the batch set to `accumulation` micro-batches per step on this machine. Precision is resolved as on a GPU
    (auto: bf16 where the GPU has it, so the CPU smoke check runs the same BF16_Optimizer path)."""
    overrides = [f"--{phase}.batch_size={micro * accumulation * world_size}", f"--{phase}.micro_batch_size={micro}",
                 f"--{phase}.gradient_accumulation_steps={accumulation}"]
    if ds_config is not None:
        overrides.append(f"--{phase}.ds_config={ds_config.resolve()}")
    return phase_ds_config(load_config(recipe, overrides), phase, world_size, "cuda", bf16_supported)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s (read + write) of a large copy, best of 5."""
    numel = (64 if device.type == "cpu" else 1024) * 2**20 // 4
    src, dst = torch.rand(numel, device=device), torch.empty(numel, device=device)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * 4 * numel / best


def lamb_shapes(preset: str, vocab: int) -> list[list[torch.Size]]:
    with torch.device("meta"):
        model = build_model(bert_config(preset, vocab))
    return [[p.shape for p in group["params"]] for group in weight_decay_param_groups(model, 0.01)]


def flat_lamb(shapes: list[list[torch.Size]], device: torch.device, fused: bool) -> ExactLamb:
    """ExactLamb over one fp32 flat per group, exactly as ZeRO-1 on one rank hands them over."""
    g = torch.Generator(device=device).manual_seed(0)
    flats, partitions = [], {}
    for key, group_shapes in enumerate(shapes):
        numels = [int(s.numel()) for s in group_shapes]
        flat = torch.randn(sum(numels), device=device, generator=g) * 0.02
        flat.grad = torch.randn(flat.shape, device=device, generator=g) * 1e-3
        starts = [sum(numels[:i]) for i in range(len(numels))]
        ranges = [(i, s, n) for i, (s, n) in enumerate(zip(starts, numels, strict=True))]
        partitions[id(flat)] = partition_from_ranges(flat.numel(), ranges, len(numels), None, key, None)
        flats.append(flat)
    groups = [{"params": [torch.empty(0)], "weight_decay": wd} for wd in (0.01, 0.0)]
    optimizer = ExactLamb(groups, lr=1e-3, fused=fused)
    for group, flat in zip(optimizer.param_groups, flats, strict=True):
        group["params"] = [flat]
    optimizer.set_zero_layout(ZeroLayout(wrapper="gpu_check", partitions=partitions))
    return optimizer


def timed_median(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lamb_row(preset: str, shapes: list[list[torch.Size]], variant: str, floor_ms: float | None, reps: int,
             device: torch.device) -> dict[str, Any]:
    """One LAMB step (median of `reps`) of the reference (`variant` "reference") or the fused compiled
    step ("fused": compile errors raise, nothing falls back)."""
    numel = sum(int(s.numel()) for group in shapes for s in group)
    optimizer = flat_lamb(shapes, device, fused=variant == "fused")
    start = time.perf_counter()
    optimizer.step()  # allocates state; compiles the fused kernels
    sync(device)
    first_s = time.perf_counter() - start
    ms = timed_median(optimizer.step, reps, device) * 1e3
    return {"model": preset, "variant": variant, "params_m": numel / 1e6, "step_ms": ms,
            "floor_ms": floor_ms, "x_floor": ms / floor_ms if floor_ms else None, "first_step_s": first_s}


def lamb_floor_ms(shapes: list[list[torch.Size]], device: torch.device) -> float:
    numel = sum(int(s.numel()) for group in shapes for s in group)
    return LAMB_FLOOR_BYTES_PER_PARAM * numel / copy_bandwidth(device) * 1e3
