"""One prepared GPU check: training throughput / MFU of BERT-Large and BERT-base, the LAMB step
against its memory-traffic floor, peak memory. Run through bench/gpu_check.sh (docs/performance.md).

    python bench/gpu_check.py [--smoke] [--models bert-large,bert-base] [--steps 20] [--warmup 5]
                              [--phase1 128:256] [--phase2 512:64] [--jsonl OUT.jsonl] [--deadline T]

Every row is saved and printed the moment it is measured: one JSON line appended (and fsynced) to
--jsonl (default ./gpu_check.jsonl; records "run", "train", "lamb", "end", all with the run's start
time as "run"), then its markdown row on stdout (table headers first). A crash, a timeout (SIGTERM:
an "end" record says so, exit 124) or a failing row keeps every row measured before it; a row that
raises is printed as "failed: <reason>" and the check goes on with the next one (exit 1 at the end).

Training rows: the engine users run. The DeepSpeed config is what the driver builds for the phase of
the shipped recipe ds_configs/recipes/bert_large_64k.json (--recipe; phase-1 shapes from phase1,
phase-2 and packed ones from phase2; --ds-config swaps the DeepSpeed JSON) with only the batch shrunk
to one micro-batch per step: its lr, run.precision resolved as on a GPU (bf16), its
ds_configs/deepspeed/lamb_zero1.json ("data_types": {"grad_accum_dtype": "fp32"}, ZeRO-1, so DeepSpeed
wraps our ExactLamb in BF16_Optimizer; gradient clipping 1.0); built by `pretrain.engine.build_engine`, sparse-MLM
model with SDPA attention, synthetic full-length rows (max_predictions = 15% of the length). Each
row records the wrapper the engine really has (`type(engine.optimizer).__name__`), the precision and
which LAMB step ran (fused compiled / reference / fused math uncompiled after a failed compile).
A "packed" row runs phase-2 shapes with 2 instances of 256 tokens per 512 row (block-diagonal mask)
and counts instances and the FLOPs of 256-token sequences. FLOPs follow pretrain/metrics.py; MFU uses
its dense bf16 peak of the device.

LAMB rows: one step over BERT-Large's parameters as ZeRO-1 flat fp32 partitions (one rank holds all):
the reference multi-tensor step first, then the fused compiled step, against the floor of ~40 bytes
per parameter (read w, g, m, v; write m, v; read + write w and the update) at the copy bandwidth
measured in this process. A fused step that fails to compile (no C compiler or Python headers for
Triton on CUDA; on CPU no C++ compiler, which --inductor-cxx /nonexistent forces) is printed as
"fused: failed: <reason>"; the reference row stands.

--smoke: CPU (DS_ACCELERATOR=cpu), tiny shapes, 2 steps, the same bf16 + BF16_Optimizer engine; the
fused LAMB row only with --fused-on-cpu. CI runs it in well under a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from deepspeed.utils import logger as ds_logger  # noqa: E402

from bench.gpu_check_preflight import DEFAULT_JSONL, DEFAULT_RECIPE, loaded_distributions  # noqa: E402
from bench.gpu_check_rows import lamb_floor_ms, lamb_row, lamb_shapes, train_row  # noqa: E402
from pretrain.engine import init_distributed  # noqa: E402

VOCAB = 30522
TRAIN_HEADER = ("| model | seq | micro | inst/row | prec | optimizer / LAMB step | step ms | seq/s | "
                "tokens/s | TFLOP/s | MFU | peak mem GB |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
LAMB_HEADER = ("| LAMB step | params (M) | step ms | floor ms (40 B/param) | x floor | first step s |\n"
               "|---|---|---|---|---|---|")


def shape_arg(text: str) -> tuple[int, int]:
    seq, micro = text.split(":")
    return int(seq), int(micro)


def one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:240]


def fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


class Recorder:
    """Appends one JSON line per record (flushed and fsynced) before its markdown row is printed."""

    def __init__(self, path: Path) -> None:
        self.path, self.run = path, time.strftime("%Y-%m-%dT%H:%M:%S")
        self.failed = self.rows = 0
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self, kind: str, record: dict[str, Any], markdown: str | None = None) -> None:
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps({"kind": kind, "run": self.run, **record}) + "\n")
            out.flush()
            os.fsync(out.fileno())
        if kind in ("train", "lamb"):
            self.rows += 1
            self.failed += record.get("status") == "failed"
        if markdown is not None:
            print(markdown, flush=True)


def train_markdown(r: dict[str, Any]) -> str:
    key = f"| {r['model']} | {r['seq_len']} | {r['micro_batch']} | {r['instances_per_row']} |"
    if r["status"] != "ok":
        return f"{key} {r['status']}: {r['reason']} |"
    return (f"{key} {r['precision']} | {r['wrapper']} / {r['lamb_step']} | {r['step_ms']:.1f} | "
            f"{r['seq_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['tflops']:.2f} | {fmt(r['mfu'], '.1%')} | "
            f"{fmt(r['peak_mem_gb'], '.1f')} |")


def lamb_markdown(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"| {r['model']} {r['variant']} | {r['variant']}: {r['status']}: {r['reason']} |"
    return (f"| {r['model']} {r['variant']} | {r['params_m']:.1f} | {r['step_ms']:.2f} | "
            f"{fmt(r['floor_ms'], '.2f')} | "
            f"{fmt(r['x_floor'], '.2f')} | {r['first_step_s']:.1f} |")


def measure(key: dict[str, Any], fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """One measurement, DeepSpeed's prints sent to stderr; one that raises (out of memory, no compiler
    for the fused step, an impossible shape, ...) is a "failed" row and the check goes on."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return {**fn(*args), "status": "ok"}
    except Exception as error:  # noqa: BLE001 - a failed row is a result
        print(f"[gpu_check] {key} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return {**key, "status": "failed", "reason": one_line(error)}


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 steps (CI)")
    parser.add_argument("--models", default="bert-large,bert-base", help="comma-separated presets, in order")
    parser.add_argument("--phase1", type=shape_arg, default=(128, 256), help="seq:micro_batch")
    parser.add_argument("--phase2", type=shape_arg, default=(512, 64), help="seq:micro_batch")
    parser.add_argument("--no-packed", action="store_true", help="skip the packed phase-2 rows")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (the first one compiles)")
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help="the shipped run config the engines come from")
    parser.add_argument("--ds-config", type=Path, default=None,
                        help="another DeepSpeed JSON of engine mechanics for every row (default: the recipe's)")
    parser.add_argument("--lamb-model", default="bert-large")
    parser.add_argument("--lamb-reps", type=int, default=10)
    parser.add_argument("--fused-on-cpu", action="store_true", help="also time the compiled LAMB on CPU")
    parser.add_argument("--inductor-cxx", default=None,
                        help="the C++ compiler torch.compile uses on CPU (inductor's cpp.cxx; default $CXX "
                             "or g++); a missing one makes the fused LAMB compile fail (the test does this)")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--peak-tflops", type=float, default=None, help="per device; default: by GPU name")
    parser.add_argument("--jsonl", type=Path, default=Path(DEFAULT_JSONL), help="one JSON line per row")
    parser.add_argument("--deadline", type=float, default=None,
                        help="unix time by which to be done (gpu_check.sh passes its limit): training rows "
                             "that would start with under --lamb-reserve-s left are skipped; LAMB rows run")
    parser.add_argument("--lamb-reserve-s", type=float, default=120.0)
    if parser.parse_known_args(argv)[0].smoke:  # smoke defaults; flags given explicitly still win
        parser.set_defaults(models="tiny", lamb_model="tiny", vocab=512, phase1=(32, 4), phase2=(64, 2),
                            steps=2, warmup=1, lamb_reps=3)
    args = parser.parse_args(argv)
    args.warmup = max(1, args.warmup)
    if args.inductor_cxx is not None:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.cxx = (None, args.inductor_cxx)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    recorder = Recorder(args.jsonl)

    def on_term(signum: int, _frame: object) -> None:  # `timeout` ends the check: keep what was measured
        recorder.save("end", {"status": f"killed by signal {signum} (time limit)", "rows": recorder.rows,
                              "seconds": time.monotonic() - started})
        print(f"gpu_check: stopped by signal {signum} after {recorder.rows} rows; they are in {args.jsonl}",
              file=sys.stderr, flush=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    imported = loaded_distributions()
    # DeepSpeed logs (and prints, see below) to stdout; keep stdout for the tables.
    for handler in ds_logger.handlers:
        if getattr(handler, "stream", None) is sys.stdout:
            handler.setStream(sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):
        dist_info = init_distributed()
    device = dist_info.device
    if device.type != "cuda" and not args.smoke:
        print("gpu_check: no CUDA device; use --smoke for the CPU check", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    recorder.save("run", {"device": device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
                          "args": {k: str(v) for k, v in vars(args).items()}})
    print(f"\n### {device_name}, torch {torch.__version__}, CUDA {torch.version.cuda}\n\n{TRAIN_HEADER}",
          flush=True)

    def left() -> float:
        return float("inf") if args.deadline is None else args.deadline - time.time()

    packed = [] if args.no_packed else [("phase2", *args.phase2, 2)]
    for preset in [m for m in args.models.split(",") if m]:
        for phase, seq, micro, per_row in [("phase1", *args.phase1, 1), ("phase2", *args.phase2, 1), *packed]:
            key = {"model": preset, "seq_len": seq, "micro_batch": micro, "instances_per_row": per_row}
            if left() < args.lamb_reserve_s:
                row = {**key, "status": "skipped", "reason": f"time budget ({left():.0f} s left)"}
            else:
                print(f"[gpu_check] {preset} seq {seq} micro {micro} x{per_row} ...", file=sys.stderr,
                      flush=True)
                row = measure(key, train_row, preset, phase, seq, micro, per_row, args, device,
                              dist_info.world_size)
            release(device)
            recorder.save("train", row, train_markdown(row))

    print(f"\n{LAMB_HEADER}", flush=True)
    shapes = lamb_shapes(args.lamb_model, args.vocab)
    # None when the bandwidth measurement fails (the rows then have no "x floor")
    floor_ms = measure({}, lambda: {"floor_ms": lamb_floor_ms(shapes, device)}).get("floor_ms")
    for variant in ("reference", "fused"):
        key = {"model": args.lamb_model, "variant": variant}
        if variant == "fused" and device.type == "cpu" and not args.fused_on_cpu:
            row = {**key, "status": "skipped", "reason": "CPU (--fused-on-cpu times it)"}
        elif left() <= 0:
            row = {**key, "status": "skipped", "reason": "time budget"}
        else:
            row = measure(key, lamb_row, args.lamb_model, shapes, variant, floor_ms, args.lamb_reps, device)
        release(device)
        recorder.save("lamb", row, lamb_markdown(row))

    loaded = loaded_distributions()
    lazily = {name: version for name, version in loaded.items() if name not in imported}
    recorder.save("end", {"status": "done", "rows": recorder.rows, "failed": recorder.failed,
                          "seconds": time.monotonic() - started, "distributions": loaded,
                          "loaded_lazily": lazily})
    print("gpu_check: wheels loaded during the run, after the imports: "
          + (" ".join(f"{n}=={v}" for n, v in lazily.items()) or "none"), file=sys.stderr)
    print(f"\ngpu_check: {recorder.rows} rows ({recorder.failed} failed) in "
          f"{time.monotonic() - started:.0f} s; "
          f"saved to {args.jsonl}", file=sys.stderr, flush=True)
    return 1 if recorder.failed else 0


if __name__ == "__main__":
    sys.exit(main())
