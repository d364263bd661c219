"""One prepared GPU check: training throughput / MFU of BERT-base and BERT-Large, the LAMB step
against its memory-traffic floor, peak memory. Run through bench/gpu_check.sh (see README.md, "Speed on GPUs").

    python bench/gpu_check.py [--smoke] [--models bert-base,bert-large] [--steps 20] [--warmup 5]
                              [--phase1 128:256] [--phase2 512:64] [--json OUT.json]

Training rows: the project's engine builder (`pretrain.engine.build_engine`) with our ExactLamb,
ZeRO-1 on one rank, bf16 on GPUs (fp32 on CPU), gradient clipping 1.0, the sparse-MLM model with
SDPA attention, synthetic full-length rows (max_predictions = 15% of the length). A "packed" row
runs phase-2 shapes with 2 instances of 256 tokens per 512 row (block-diagonal mask) and counts
instances and the FLOPs of 256-token sequences: what packing buys on data that is half padding.
FLOPs follow pretrain/metrics.py; MFU uses the table's dense bf16 peak of the device.

LAMB rows: one step over BERT-Large's parameters as ZeRO-1 flat fp32 partitions (one rank holds all),
reference multi-tensor step vs the fused compiled step, against the floor of ~40 bytes per
parameter (read w, g, m, v; write m, v; read + write w and the update) at the copy bandwidth
measured in this process.

--smoke: CPU, tiny shapes, 2 steps; checks the whole script in CI in well under a minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pretrain.engine import build_engine, init_distributed  # noqa: E402
from pretrain.lamb import Lamb, weight_decay_param_groups  # noqa: E402
from pretrain.metrics import flops_per_sequence, peak_tflops  # noqa: E402
from pretrain.model import bert_config, build_model, count_parameters  # noqa: E402
from pretrain.packing import MAX_INSTANCES_PER_ROW  # noqa: E402
from pretrain.zero_lamb import ZeroLayout, partition_from_ranges  # noqa: E402

LAMB_FLOOR_BYTES_PER_PARAM = 40
VOCAB = 30522


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shape_arg(text: str) -> tuple[int, int]:
    seq, micro = text.split(":")
    return int(seq), int(micro)


def synthetic_batch(micro: int, seq: int, predictions: int, vocab: int, instances_per_row: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Full rows of random tokens; with instances_per_row > 1, a packed layout of equal instances."""
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(5, vocab, (micro, seq), generator=g),
        "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(micro, seq).clone(),
        "attention_mask": torch.ones(micro, seq, dtype=torch.long),
        "masked_positions": torch.argsort(torch.rand(micro, seq - 1, generator=g), dim=1)[:, :predictions] + 1,
        "masked_labels": torch.randint(5, vocab, (micro, predictions), generator=g),
        "next_sentence_label": torch.randint(0, 2, (micro,), generator=g),
    }
    if instances_per_row > 1:
        length = seq // instances_per_row
        slots = MAX_INSTANCES_PER_ROW
        batch["segment_ids"] = (torch.arange(seq) // length + 1).expand(micro, seq).clone()
        batch["position_ids"] = (torch.arange(seq) % length).expand(micro, seq).clone()
        batch["token_type_ids"] = ((torch.arange(seq) % length) >= length // 2).long().expand(micro, seq).clone()
        cls = torch.zeros(micro, slots, dtype=torch.long)
        cls[:, :instances_per_row] = torch.arange(instances_per_row) * length
        batch["cls_positions"] = cls
        nsp = torch.full((micro, slots), -100, dtype=torch.long)
        nsp[:, :instances_per_row] = torch.randint(0, 2, (micro, instances_per_row), generator=g)
        batch["next_sentence_label"] = nsp.reshape(-1)
    return {k: v.to(device) for k, v in batch.items()}


def train_row(preset: str, seq: int, micro: int, instances_per_row: int, args: argparse.Namespace,
              device: torch.device, precision: str) -> dict[str, Any]:
    config = bert_config(preset, args.vocab, max_position_embeddings=max(512, seq))
    torch.manual_seed(0)
    model = build_model(config)
    counts = count_parameters(model)
    ds = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1}, "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "ExactLamb", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    engine = build_engine(model, ds)
    length = seq // instances_per_row
    predictions = max(1, round(0.15 * length)) * instances_per_row
    batch = synthetic_batch(micro, seq, predictions, args.vocab, instances_per_row, device)

    def step() -> None:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

    for _ in range(args.warmup):
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
    row = {
        "model": preset, "seq_len": seq, "micro_batch": micro, "instances_per_row": instances_per_row,
        "precision": precision, "step_ms": seconds * 1e3, "seq_per_s": seq_per_s,
        "tokens_per_s": seq_per_s * length, "tflops": tflops, "mfu": tflops / peak if peak else None,
        "peak_mem_gb": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
    }
    engine.destroy()
    gc.collect()
    return row


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


def flat_lamb(shapes: list[list[torch.Size]], device: torch.device, fused: bool) -> Lamb:
    """Our Lamb over one fp32 flat per group, exactly as ZeRO-1 on one rank hands them over."""
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
    optimizer = Lamb([{"params": [torch.empty(0)], "weight_decay": wd} for wd in (0.01, 0.0)], lr=1e-3, fused=fused)
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


def lamb_rows(preset: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    with torch.device("meta"):
        model = build_model(bert_config(preset, args.vocab))
    shapes = [[p.shape for p in group["params"]] for group in weight_decay_param_groups(model, 0.01)]
    numel = sum(int(s.numel()) for group in shapes for s in group)
    floor_ms = LAMB_FLOOR_BYTES_PER_PARAM * numel / copy_bandwidth(device) * 1e3
    variants = {"reference": False} if device.type == "cpu" and not args.fused_on_cpu else {
        "reference": False, "fused": True}
    rows = []
    for name, fused in variants.items():
        optimizer = flat_lamb(shapes, device, fused)
        start = time.perf_counter()
        optimizer.step()  # allocates state; compiles the fused kernels
        sync(device)
        first_s = time.perf_counter() - start
        ms = timed_median(optimizer.step, args.lamb_reps, device) * 1e3
        rows.append({"model": preset, "variant": name, "params_m": numel / 1e6, "step_ms": ms,
                     "floor_ms": floor_ms, "x_floor": ms / floor_ms, "first_step_s": first_s})
        del optimizer
        gc.collect()
    return rows


def print_tables(train: list[dict[str, Any]], lamb: list[dict[str, Any]], device_name: str) -> None:
    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    print(f"\n### {device_name}\n")
    print("| model | seq | micro | inst/row | prec | step ms | seq/s | tokens/s | TFLOP/s | MFU | peak mem GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in train:
        print(f"| {r['model']} | {r['seq_len']} | {r['micro_batch']} | {r['instances_per_row']} | {r['precision']} | "
              f"{r['step_ms']:.1f} | {r['seq_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['tflops']:.2f} | "
              f"{fmt(r['mfu'], '.1%')} | {fmt(r['peak_mem_gb'], '.1f')} |")
    print("\n| LAMB step | params (M) | step ms | floor ms (40 B/param) | x floor | first step s |")
    print("|---|---|---|---|---|---|")
    for r in lamb:
        print(f"| {r['model']} {r['variant']} | {r['params_m']:.1f} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | "
              f"{r['x_floor']:.2f} | {r['first_step_s']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 steps (CI)")
    parser.add_argument("--models", default="bert-base,bert-large")
    parser.add_argument("--phase1", type=shape_arg, default=(128, 256), help="seq:micro_batch")
    parser.add_argument("--phase2", type=shape_arg, default=(512, 64), help="seq:micro_batch")
    parser.add_argument("--no-packed", action="store_true", help="skip the packed phase-2 rows")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lamb-model", default="bert-large")
    parser.add_argument("--lamb-reps", type=int, default=10)
    parser.add_argument("--fused-on-cpu", action="store_true", help="also time the compiled LAMB on CPU")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--peak-tflops", type=float, default=None, help="per device; default: from the GPU name")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.lamb_model, args.vocab = "tiny", "tiny", 512
        args.phase1, args.phase2, args.steps, args.warmup, args.lamb_reps = (32, 4), (64, 2), 2, 1, 3

    dist_info = init_distributed()
    device = dist_info.device
    if device.type != "cuda" and not args.smoke:
        print("gpu_check: no CUDA device; use --smoke for the CPU check", file=sys.stderr)
        return 2
    precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    train: list[dict[str, Any]] = []
    for preset in args.models.split(","):
        shapes = [(*args.phase1, 1), (*args.phase2, 1)] + ([] if args.no_packed else [(*args.phase2, 2)])
        for seq, micro, per_row in shapes:
            started = time.perf_counter()
            train.append(train_row(preset, seq, micro, per_row, args, device, precision))
            print(f"[gpu_check] {preset} seq {seq} x{per_row}: {train[-1]['seq_per_s']:.1f} seq/s "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    lamb = lamb_rows(args.lamb_model, args, device)
    print_tables(train, lamb, f"{device_name}, torch {torch.__version__}")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": device_name, "train": train, "lamb": lamb}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
