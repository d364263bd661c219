"""The kernel self-test: the unpadded path's kernel, on the run's own device and dtype, in seconds, in two stages.

CI has no GPU, so the flash varlen call of the unpadded path (pretrain/model/varlen_attention.py) is first executed
on the user's device. Before training, each node's first local rank runs this test (pretrain/plan/run_plan.py
`settle_attention` agrees on the verdict over all ranks).

Stage 1, the kernel alone (pretrain/device_check/kernel_check.py): the kernel in the run's dtype against the fp32
reference kernel on the same rounded q/k/v, forward and backward, with a limit set by the dtype's own rounding
(0.8 eps: bf16 6.25e-3). It sees a kernel 1 % off in bf16, which stage 2 cannot: stage 2 must admit the dtype's
noise through a whole model (in bf16 it passed a kernel 10 % off at seq 512). Then a smoke check of the kernel
with attention dropout on (finite, it changes the outputs, the mean output kept), which has no reference.

Stage 2, the plumbing around it: a small BERT with the run's head size, 2 heads and 2 layers, dropout 0, in train
mode, forward and backward on four micro-batches whose lengths hold the edge cases (many segments with a full row
and a bucket tail; one segment that fills the row, so the tail segment is empty; two segments that fill the
bucket exactly; one short segment), through

- the padded path in fp32 (the reference),
- the padded path in the run's dtype (how far the dtype alone moves the outputs: the noise),
- the unpadded path in the run's dtype, with the device's kernel (or `kernel`, the tests' seam).

It passes when, on every micro-batch, the unpadded path's relative error against the reference (logits of
every MLM slot and NSP; every parameter's gradient) is within SLACK x the padded path's own error in that
dtype, plus a floor for the dtype: the unpadded kernel may round differently, not compute something else.
In fp32 the padded run is the reference itself, so the limit is the floor alone.

The test passes when both stages do. A kernel that raises fails with its error. The numbers are what the launch
line prints (the kernel stage's first).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from pretrain.data.batches import pad_masked_instances
from pretrain.data.unpadded import unpad_masked_instances
from pretrain.device_check.kernel_check import dropout_problem, kernel_error, kernel_limit
from pretrain.device_check.run_shape import RunShape
from pretrain.device_check.verdict import SelfTestResult, over
from pretrain.model.bert import SparseBertForPreTraining, bert_config, build_model
from pretrain.model.unpadded import LAYER_FORWARD_ATTRIBUTE, LayerForward, unpadded_layer
from pretrain.model.varlen_attention import VarlenKernel, varlen_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SLACK = 4.0  # the unpadded error may be this many times the padded path's own error in the dtype
FLOOR = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 5e-4}  # relative error any kernel is allowed in the dtype
VOCAB, PREDICTIONS, PAD_ID = 128, 4, 0
INIT_SCALE = 2.0  # weight std x sqrt(hidden): attention dominates the outputs (small_model)


def edge_case_lengths(seq_len: int) -> list[list[int]]:
    """Instance lengths of the test's micro-batches at `seq_len` (module docstring); T of the second and third
    is a multiple of the bucket, so their tail segment is empty."""
    batches = [[seq_len, seq_len // 2 - 7, 9, seq_len - 2, 3, 31], [seq_len], [seq_len - 28, 28], [seq_len // 4 + 5]]
    return [[n for n in lengths if 3 <= n <= seq_len] for lengths in batches]


def instances(lengths: list[int], seed: int) -> list[dict]:
    """Masked instances as the collator hands them to a layout (ids, a_len, positions, labels, nsp)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(5, VOCAB, n)
        positions = np.sort(rng.choice(np.arange(1, n - 1), size=min(PREDICTIONS, n - 2), replace=False))
        out.append({"ids": ids, "a_len": max(1, n // 2), "positions": positions,
                    "labels": rng.integers(5, VOCAB, len(positions)), "nsp": int(rng.integers(0, 2))})
    return out


def small_model(head_dim: int, seq_len: int) -> SparseBertForPreTraining:
    """2 layers of 2 heads of the run's head size, dropout 0, weights from a fixed seed (fp32).

    The weights are drawn with std INIT_SCALE / sqrt(hidden), not BERT's 0.02: at 0.02 the attention adds about
    1 % to the residual stream, so a kernel that attends across segments moved the logits by 1 %, inside bf16's
    noise; at 2 / sqrt(hidden) it moves them by 30-60 % while bf16 moves them by 1-3 % (measured on CPU)."""
    hidden = 2 * head_dim
    config = bert_config("tiny", VOCAB, seq_len, hidden_size=hidden, num_attention_heads=2, num_hidden_layers=2,
                         intermediate_size=4 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         initializer_range=INIT_SCALE / hidden**0.5)
    torch.manual_seed(0)
    return build_model(config)


def outputs(model: SparseBertForPreTraining, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(MLM and NSP logits, every parameter's gradient), flat and in fp32, of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    logits = torch.cat([out.mlm_logits.float().flatten(), out.nsp_logits.float().flatten()])
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return logits.detach(), grads


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def on(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def compare(device: torch.device, precision: str, head_dim: int, seq_len: int,
            layer: LayerForward) -> dict[str, tuple[float, float]]:
    """{"logits" | "grads": (error, limit)} of the micro-batch where the error is furthest from its limit; `layer`:
    the unpadded path's layer function (the eager layer with the kernel under test, or the compiled layer)."""
    reference = small_model(head_dim, seq_len).to(device)
    low = small_model(head_dim, seq_len).to(device, DTYPES[precision])
    setattr(low, LAYER_FORWARD_ATTRIBUTE, layer)
    worst = {"logits": (0.0, 1.0), "grads": (0.0, 1.0)}
    for seed, lengths in enumerate(edge_case_lengths(seq_len)):
        masked = instances(lengths, seed)
        padded = on(pad_masked_instances(masked, seq_len, PREDICTIONS, PAD_ID), device)
        unpadded = on(unpad_masked_instances(masked, seq_len, PREDICTIONS, PAD_ID), device)
        want = outputs(reference, padded)
        noise = outputs(low, padded) if precision != "fp32" else want
        got = outputs(low, unpadded)
        for index, name in enumerate(worst):
            error = relative(got[index], want[index])
            limit = SLACK * relative(noise[index], want[index]) + FLOOR[precision]
            if over(error, limit) >= over(*worst[name]):
                worst[name] = (error, limit)
    return worst


def kernel_self_test(device: torch.device, precision: str, head_dim: int, seq_len: int = 128,
                     shape: RunShape | None = None, kernel: VarlenKernel = varlen_attention) -> SelfTestResult:
    """The test of the module docstring on `device` in `precision` (bf16 | fp16 | fp32); never raises for the
    kernel's sake: an error is a failed verdict. `shape`: the run's (pretrain/device_check/run_shape.py), for the kernel
    stage's case at the run's heads and micro-batch (None: the edge cases alone). The global RNG is left as it
    was."""
    where = f"{device} {precision}"
    started = time.perf_counter()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            parts = kernel_error(device, DTYPES[precision], head_dim, edge_case_lengths(seq_len), kernel, shape)
            dropout = dropout_problem(device, DTYPES[precision], head_dim, edge_case_lengths(seq_len)[0], kernel)
            worst = compare(device, precision, head_dim, seq_len, functools.partial(unpadded_layer, kernel=kernel))
        except Exception as error:  # noqa: BLE001 - a kernel this device cannot run, a wrong shape: a failed verdict
            first = (str(error).strip().splitlines() or [""])[0][:200]
            return SelfTestResult(False, where, seconds=time.perf_counter() - started,
                                  failure=f"{type(error).__name__}: {first}")
    part = max(parts, key=lambda name: over(parts[name], 1.0))
    worst["kernel"] = (parts[part], kernel_limit(DTYPES[precision]))
    passed = all(over(*pair) <= 1 for pair in worst.values()) and dropout is None
    return SelfTestResult(passed, where, *worst["logits"], *worst["grads"], time.perf_counter() - started,
                          kernel_error=worst["kernel"][0], kernel_limit=worst["kernel"][1], kernel_part=part,
                          problem=dropout)
