"""Markdown rows of bench/gpu_check/run.py and the recipe phases its estimate covers."""

from __future__ import annotations

import argparse
from typing import Any

from bench.gpu_check.estimate import PhaseRun
from bench.gpu_check.plan import TARGET_GPU, runs_unpadded, shape_of
from pretrain.config.deepspeed import read_ds_json
from pretrain.config.load import load_config
from pretrain.model.kernel_support import DeviceFacts

TRAIN_HEADER = (
    "| row | model | seq | micro x A | data | timer | optimizer / LAMB step | step s | ms / micro | inst/s | "
    "real tok/s | padding | inst/row | data wait ms | device TFLOP/s | device MFU (padding incl.) | "
    "model MFU (real tokens: a run's perf/mfu) | peak alloc / reserved GB | "
    "fits 80 GB | compile |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)
# What the training rows' throughput keys measure, saved in the file's "run" record so that a reader of the JSON
# lines compares like with like: a run's perf/mfu is the model MFU, not the device MFU.
COLUMNS = {
    "device_tflops": "FLOP/s the device computed, padding included (a run's perf/device_tflops)",
    "device_mfu": "device MFU: device_tflops / the GPU's dense peak (a run's perf/device_mfu); padded rows count "
                  "their padding as work",
    "model_mfu": "model MFU: the model's FLOPs on real tokens only / the GPU's dense peak (a run's perf/mfu, "
                 "the number to compare with a training run's)",
}
LAMB_HEADER = ("| LAMB step | params (M) | step ms | floor ms (40 B/param) | x floor | first step s |\n"
               "|---|---|---|---|---|---|")


def fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def yes_no(value: bool | None) -> str:
    return "n/a" if value is None else "yes" if value else "no"


def compile_cell(r: dict[str, Any]) -> str:
    """The compiled layer in a training row (bench/gpu_check/train.py `compile_state`): its graphs and recompiles so
    far over the recipe's engines (a run counts them over its phases: phase 2's new max_seqlen is a recompile),
    why it fell back to eager, or that it is not compiled."""
    if not r.get("unpadded"):
        return "n/a (padded rows)"
    if "compile/recompiles" not in r:
        return "eager"
    if r.get("compile/fallback"):
        reason = str(r.get("compile_fallback") or "see stderr").replace("|", "\\|")
        return f"fell back: {reason}"
    return f"graphs {r.get('compile/graphs', 0):.0f}, recompiles {r['compile/recompiles']:.0f}"


def train_markdown(r: dict[str, Any]) -> str:
    data = f"{r['profile']}{' packed' if r['packing'] else ''}{' unpadded' if r.get('unpadded') else ''}"
    key = (f"| {r['name']} | {r['model']} | {r['seq_len']} | {r['micro_batch']} x {r['accumulation']} | {data} | "
           f"{'on' if r['tput_timer'] else 'off'} |")
    if r["status"] != "ok":
        return f"{key} {r['status']}: {r['reason']} |"
    memory = f"{fmt(r['peak_alloc_gb'], '.1f')} / {fmt(r['peak_reserved_gb'], '.1f')}"
    return (f"{key} {r['wrapper']} / {r['lamb_step']} | {r['step_s']:.3f} | {r['micro_ms']:.1f} | "
            f"{r['inst_per_s']:.1f} | {r['real_tokens_per_s']:.0f} | {r.get('data/padding_fraction', 0.0):.1%} | "
            f"{r.get('data/packing_factor', 1.0):.2f} | {fmt(r['data_wait_ms'], '.1f')} | {r['device_tflops']:.2f} | "
            f"{fmt(r['device_mfu'], '.1%')} | {fmt(r.get('model_mfu'), '.1%')} | {memory} | "
            f"{yes_no(r['fits_80gb'])} | {compile_cell(r)} |")


def lamb_markdown(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"| {r['model']} {r['variant']} | {r['variant']}: {r['status']}: {r['reason']} |"
    return (f"| {r['model']} {r['variant']} | {r['params_m']:.1f} | {r['step_ms']:.2f} | "
            f"{fmt(r['floor_ms'], '.2f')} | {fmt(r['x_floor'], '.2f')} | {r['first_step_s']:.1f} |")


def grad_bytes(ds: dict[str, Any]) -> int:
    """Bytes per gradient element in the boundary all-reduce: DeepSpeed reduces in the training precision
    (bf16/fp16: 2) unless the JSON sets communication_data_type."""
    return 4 if str(ds.get("communication_data_type", "")).lower() in ("fp32", "float32", "float") else 2


def estimate_runs(args: argparse.Namespace, facts: DeviceFacts = TARGET_GPU) -> tuple[list[PhaseRun], list[str]]:
    """The phases of the --estimate-recipes at the shapes their rows were measured at (--model, --phase1/2
    replace the recipe's as for the rows), in the attention path they run on a device with `facts` (the check's
    own; --estimate-only: the GPU the check is for), and why a phase cannot be estimated."""
    runs, problems = [], []
    for recipe in args.estimate_recipes:
        try:
            config = load_config(recipe)
            for phase in config.run.phases:
                section = config.phase(phase)
                if section.batch_size is None:
                    problems.append(f"{recipe.stem} {phase}: the recipe sets no batch_size")
                    continue
                model, seq, micro = shape_of(args, recipe, phase)
                ds = read_ds_json(args.ds_config or section.ds_config, f"{phase}.ds_config")
                runs.append(PhaseRun(recipe.stem, phase, model, seq, micro, section.batch_size, section.steps,
                                     section.packing, grad_bytes(ds), runs_unpadded(config, model, facts)))
        except (ValueError, OSError) as error:  # ConfigError is a ValueError
            problems.append(f"{recipe}: {error}".splitlines()[0])
    return runs, problems
