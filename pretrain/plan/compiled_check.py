"""The self-test of the compiled layer: what inductor generates for this device, checked before training.

Why: the kernel self-test (pretrain/plan/self_test.py) runs the layer eager, so a compiled run's first execution
of inductor's code (its Triton kernels around the flash call, with a symbolic token count) is the run itself, and
a wrong kernel there would train silently. This repeats the self-test's whole-model stage with the unpadded side
through a `CompiledLayer` (strict=False, the run's backend): the small BERT, forward and backward on the edge-case
micro-batches, against the fp32 padded reference, within the same limit (4x the padded path's own error in the
dtype plus a floor). A layer that falls back instead of compiling fails with the fallback's reason (the run would
fall back the same way, with the same line).

Cost: one compile of the small model (tens of seconds with inductor on 2 CPU cores, seconds on a GPU), so it is
for runs whose plan compiles. The run plan's `settle_attention` (pretrain/plan/run_plan.py) decides whether to call it;
the tests pass a backend with no code generation.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from pretrain.model.compiled import CompiledLayer, ignore
from pretrain.model.unpadded import unpadded_layer
from pretrain.model.varlen_attention import VarlenKernel, varlen_attention
from pretrain.plan.self_test import SelfTestResult, compare, over


def compiled_self_test(device: torch.device, precision: str, head_dim: int, seq_len: int = 128,
                       backend: Any = "inductor", kernel: VarlenKernel = varlen_attention) -> SelfTestResult:
    """The compiled layer against the fp32 padded reference on `device` in `precision` (module docstring); never
    raises for the compiler's sake: a fallback or an error is a failed verdict. The global RNG is left as it was."""
    where = f"{device} {precision} compiled"
    started = time.perf_counter()
    layer = CompiledLayer(functools.partial(unpadded_layer, kernel=kernel), strict=False, say=ignore, backend=backend)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            worst = compare(device, precision, head_dim, seq_len, layer)
        except Exception as error:  # noqa: BLE001 - code the compiler generated that this device cannot run
            first = (str(error).strip().splitlines() or [""])[0][:200]
            return SelfTestResult(False, where, seconds=time.perf_counter() - started,
                                  failure=f"{type(error).__name__}: {first}")
    fell_back = None if layer.fallback is None else f"the compiled layer fell back: {layer.fallback}"
    passed = all(over(*pair) <= 1 for pair in worst.values()) and fell_back is None
    return SelfTestResult(passed, where, *worst["logits"], *worst["grads"], time.perf_counter() - started,
                          problem=fell_back)
