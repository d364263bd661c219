"""The measurements of bench/gpu_check.py: one training row, one LAMB-step row (see its docstring)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pretrain.config import load_config
from pretrain.ds_config import phase_ds_config
from pretrain.engine import build_engine, client_optimizer
from pretrain.metrics import flops_per_sequence, peak_tflops
from pretrain.model import bert_config, build_model, count_parameters
from pretrain.optim.lamb import ExactLamb, weight_decay_param_groups
from pretrain.optim.zero_layout import ZeroLayout, partition_from_ranges
from pretrain.packing import MAX_INSTANCES_PER_ROW

LAMB_FLOOR_BYTES_PER_PARAM = 40


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_config(recipe: Path, phase: str, micro: int, world_size: int, ds_config: Path | None = None,
                  bf16_supported: bool = True) -> dict[str, Any]:
    """What the driver builds for `phase` of the shipped `recipe` (its DeepSpeed JSON: grad_accum_dtype fp32,
    ZeRO-1, ExactLamb, clipping 1.0; its lr; run.precision), through the driver's own config code, with only
    the batch shrunk to one micro-batch per step on this machine. Precision is resolved as on a GPU
    (auto: bf16 where the GPU has it, so the CPU smoke check runs the same BF16_Optimizer path)."""
    overrides = [f"--{phase}.batch_size={micro * world_size}", f"--{phase}.micro_batch_size={micro}",
                 f"--{phase}.gradient_accumulation_steps=1"]
    if ds_config is not None:
        overrides.append(f"--{phase}.ds_config={ds_config.resolve()}")
    return phase_ds_config(load_config(recipe, overrides), phase, world_size, "cuda", bf16_supported)


def ds_config_path(recipe: Path, phase: str, ds_config: Path | None = None) -> Path:
    """The DeepSpeed JSON a row's engine was built from: --ds-config, else the recipe's for that phase."""
    return (ds_config or Path(load_config(recipe).phase(phase).ds_config)).resolve()


def synthetic_batch(micro: int, seq: int, predictions: int, vocab: int, instances_per_row: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Full rows of random tokens; with instances_per_row > 1, a packed layout of equal instances."""
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(5, vocab, (micro, seq), generator=g),
        "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(micro, seq).clone(),
        "attention_mask": torch.ones(micro, seq, dtype=torch.long),
        "masked_positions": (
            torch.argsort(torch.rand(micro, seq - 1, generator=g), dim=1)[:, :predictions] + 1),
        "masked_labels": torch.randint(5, vocab, (micro, predictions), generator=g),
        "next_sentence_label": torch.randint(0, 2, (micro,), generator=g),
    }
    if instances_per_row > 1:
        length = seq // instances_per_row
        slots = MAX_INSTANCES_PER_ROW
        batch["segment_ids"] = (torch.arange(seq) // length + 1).expand(micro, seq).clone()
        batch["position_ids"] = (torch.arange(seq) % length).expand(micro, seq).clone()
        second = (torch.arange(seq) % length) >= length // 2
        batch["token_type_ids"] = second.long().expand(micro, seq).clone()
        cls = torch.zeros(micro, slots, dtype=torch.long)
        cls[:, :instances_per_row] = torch.arange(instances_per_row) * length
        batch["cls_positions"] = cls
        nsp = torch.full((micro, slots), -100, dtype=torch.long)
        nsp[:, :instances_per_row] = torch.randint(0, 2, (micro, instances_per_row), generator=g)
        batch["next_sentence_label"] = nsp.reshape(-1)
        # Packed MLM targets (pretrain/packing.py): [instances, predictions per instance], each a flat
        # index into the micro x seq tokens, so the head runs on as many rows as unpacked.
        per_instance = predictions // instances_per_row
        instances = micro * instances_per_row
        within = torch.argsort(torch.rand(instances, length - 1, generator=g), dim=1)[:, :per_instance] + 1
        starts = torch.arange(instances).unsqueeze(1) * length  # row r, slot k starts at r*seq + k*length
        batch["masked_positions"] = starts + within
        batch["masked_labels"] = torch.randint(5, vocab, (instances, per_instance), generator=g)
    return {k: v.to(device) for k, v in batch.items()}


def lamb_step_kind(engine: Any) -> str:
    """Which step ExactLamb ran inside the engine: the reference multi-tensor step, the compiled fused
    one, or the fused math uncompiled (fused=None falls back there when compiling fails)."""
    kernels = getattr(client_optimizer(engine), "_fused_kernels", None)
    if kernels is None:
        return "reference"
    return "fused" if kernels.compiled else "fused-eager (compile failed)"


def train_row(preset: str, phase: str, seq: int, micro: int, instances_per_row: int, args: argparse.Namespace,
              device: torch.device, world_size: int) -> dict[str, Any]:
    config = bert_config(preset, args.vocab, max_position_embeddings=max(512, seq))
    torch.manual_seed(0)
    model = build_model(config)
    counts = count_parameters(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    bf16_ok = torch.cuda.is_bf16_supported() if device.type == "cuda" else True
    engine = build_engine(model, engine_config(args.recipe, phase, micro, world_size, args.ds_config, bf16_ok))
    build_s = time.perf_counter() - started
    try:
        precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        length = seq // instances_per_row
        predictions = max(1, round(0.15 * length)) * instances_per_row
        batch = synthetic_batch(micro, seq, predictions, args.vocab, instances_per_row, device)
        losses = []

        def step() -> None:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())

        started = time.perf_counter()
        step()  # the first step also compiles the fused LAMB kernels (once per process)
        sync(device)
        first_step_s = time.perf_counter() - started
        for _ in range(args.warmup - 1):
            step()
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync(device)
        seconds = (time.perf_counter() - start) / args.steps
        sequences = micro * instances_per_row
        flops = instances_per_row * flops_per_sequence(
            counts["encoder"], counts["mlm_head"], config.num_hidden_layers, config.hidden_size, length,
            predictions // instances_per_row,
        )
        seq_per_s = sequences / seconds
        tflops = seq_per_s * flops / instances_per_row / 1e12
        peak = peak_tflops(device, precision, args.peak_tflops)
        return {
            "model": preset, "seq_len": seq, "micro_batch": micro, "instances_per_row": instances_per_row,
            "precision": precision, "wrapper": type(engine.optimizer).__name__,
            "lamb_step": lamb_step_kind(engine),
            "recipe": f"{args.recipe}:{phase}", "ds_config": str(ds_config_path(args.recipe, phase, args.ds_config)),
            "step_ms": seconds * 1e3, "seq_per_s": seq_per_s,
            "tokens_per_s": seq_per_s * length, "tflops": tflops, "mfu": tflops / peak if peak else None,
            "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "loss": float(losses[-1]), "build_s": build_s, "first_step_s": first_step_s,
        }
    finally:
        engine.destroy()


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
