"""The kernel self-test's verdict table: what `model.attention=auto` will run on this device, and why.

The first rows of the check, in seconds (`--rows selftest` runs them alone: the first command on a new
cluster). For each precision the device computes in (CUDA: bf16 where it has it, and fp16; CPU: fp32 and bf16)
and each head size and sequence length of the recipes, the driver's own pieces: the device's facts
(pretrain/model/kernel_support.py) and, where the unpadded kernel can run, the kernel self-test a run does
before training (pretrain/plan/self_test.py): its kernel stage (the kernel alone against the fp32 reference,
limit from the dtype's rounding: the column the first GPU run should be read for; a dropout smoke check) and its
whole-model stage. A FAIL counts as a failed row (exit 1): `auto` would run padded there and an explicit
`model.attention=unpadded` would be refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.gpu_check.plan import shape_of
from pretrain.model.kernel_support import DeviceFacts, unpadded_kernel, unpadded_problem
from pretrain.model.presets import PRESETS
from pretrain.plan.self_test import kernel_self_test

SELFTEST_HEADER = ("| self-test | device | precision | head | seq | kernel | kernel error (limit) | logits error (limit) "
                   "| gradients error (limit) | s | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|")


def selftest_cases(args: argparse.Namespace, facts: DeviceFacts) -> list[tuple[str, int, int]]:
    """(precision, head size, seq_len) of every row: the device's precisions x the recipes' shapes."""
    precisions = ["fp32", "bf16"]
    if facts.device_type == "cuda":
        precisions = ["bf16", "fp16"] if facts.bf16 else ["fp16"]
    shapes = set()
    for recipe in [args.recipe, *args.also_recipes]:
        for phase in ("phase1", "phase2"):
            preset, seq, _ = shape_of(args, Path(recipe), phase)
            shapes.add((PRESETS[preset]["hidden_size"] // PRESETS[preset]["num_attention_heads"], seq))
    return [(precision, head, seq) for precision in precisions for head, seq in sorted(shapes)]


def selftest_row(device: torch.device, facts: DeviceFacts, precision: str, head: int, seq: int) -> dict[str, Any]:
    row: dict[str, Any] = {"name": f"selftest-{precision}-h{head}-s{seq}", "device": str(device),
                           "precision": precision, "head_dim": head, "seq_len": seq, "kernel": unpadded_kernel(facts)}
    problem = unpadded_problem(facts, precision, head)
    if problem is not None:
        return {**row, "verdict": "padded", "reason": problem}
    result = kernel_self_test(device, precision, head, seq)
    return {**row, "verdict": "PASS" if result.passed else "FAIL", "kernel_error": result.kernel_error,
            "kernel_limit": result.kernel_limit, "kernel_part": result.kernel_part, "logits_error": result.logits_error,
            "logits_limit": result.logits_limit, "grads_error": result.grads_error, "grads_limit": result.grads_limit,
            "seconds": result.seconds, "failure": result.failure, "problem": result.problem}


def selftest_markdown(r: dict[str, Any]) -> str:
    start = f"| {r['name']} | {r.get('device', '')} | {r.get('precision', '')} | {r.get('head_dim', '')} | " \
            f"{r.get('seq_len', '')} |"
    if r["status"] != "ok":
        return f"{start} {r['status']}: {r['reason']} |"
    if r["verdict"] == "padded":
        return f"{start} none: {r['reason']} | | | | | padded (auto runs padded SDPA) |"
    if r["failure"] is not None:
        return f"{start} {r['kernel']} | raised: {r['failure']} | | | {r['seconds']:.1f} | FAIL |"
    outcome = "PASS (auto runs unpadded)" if r["verdict"] == "PASS" else "FAIL (auto runs padded)"
    if r.get("problem"):
        outcome += f": {r['problem']}"
    return (f"{start} {r['kernel']} | {r['kernel_error']:.1e} ({r['kernel_part']}; {r['kernel_limit']:.1e}) | "
            f"{r['logits_error']:.1e} ({r['logits_limit']:.1e}) | {r['grads_error']:.1e} "
            f"({r['grads_limit']:.1e}) | {r['seconds']:.1f} | {outcome} |")
