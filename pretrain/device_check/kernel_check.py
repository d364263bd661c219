"""The self-test's first stage: the varlen attention kernel alone, in the run's dtype, against an fp32 reference.

Why a stage of its own: the whole-model comparison (pretrain/device_check/unpadded_check.py) must admit the dtype's noise
through the whole model (bf16 moves a 2-layer BERT's logits by 1-3 % and its gradients by 4-16 %), so a kernel
5-10 % off passed it in bf16. Here the only error left is the kernel's own rounding: q, k, v (and the gradient
flowing into the output) are drawn once, rounded to the run's dtype, and handed

- to the kernel under test in that dtype, and
- to the reference kernel (pretrain/model/varlen_attention.py) in fp32, on the same rounded values,

forward and backward (output, dq, dk, dv), on the real tokens of micro-batches that hold the edge cases (many
segments with a full row and a bucket tail; one segment filling the row, so the tail segment is empty; two
segments filling the bucket exactly; one short segment), at the run's seq_len (128 and 512 in the recipes), with
HEADS heads, and on one micro-batch as the run has it (pretrain/device_check/run_shape.py): the run's head count (16 in
bert-large) and its micro-batch of instances (65 segments at seq 128 x 64), so a kernel wrong only past 8 segments
or 2 heads fails here, in the contained test, not in the rank at step 1.

The limit, from the dtype's rounding alone. A correct kernel rounds its result to the dtype once (unit roundoff
u = eps / 2: the element's relative error is uniform-ish in [-u, u], so the norm-wise relative error of one
rounding is about u / sqrt(3) = 0.29 eps) and rounds a few intermediates on the way (flash keeps P in the dtype
for P @ V; its backward rounds dS and dP the same way): about sqrt(3) roundings of that size, 0.5 eps, for the
gradients. The errors here are relative to the output's norm (a norm-wise relative error), so the limit scales
with the output's magnitude. Limit: LIMIT_EPS x eps = 0.8 eps, 1.6x the three-rounding estimate and 2.8x
one rounding; bf16 (eps 2^-7): 6.2e-3, fp16 (eps 2^-10): 7.8e-4. A kernel whose output (or gradient) is 1 % off
has a relative error of 1e-2 = 1.28 eps in bf16, over the limit by 1.6x; 0.8 eps sits halfway (geometrically)
between that and what the reference kernel measures in bf16 at seq 512 on CPU (dk, dv 3.9e-3 = 0.5 eps, as
estimated): docs/performance.md has the table. In fp32 the reference on CPU is the
kernel itself, so the error is 0; the limit keeps a floor of FP32_FLOOR for another fp32 kernel's summation order.
The fp32 reference runs with TF32 off (`exact_fp32`, through torch's fp32_precision settings): TF32 rounds matmul
inputs to 10 bits, a bf16-sized error of its own.

Attention dropout (BERT's 0.1) has no reference: flash draws its own random mask. `dropout_problem` is a smoke
check of the kernel at DROPOUT on the first micro-batch: the output and the gradients are finite, dropout changes
them (a kernel that ignores its dropout argument trains without it), and the mean output stays within
DROPOUT_MEAN of the no-dropout one on values of mean 1 (inverted dropout keeps the expectation; a kernel that
forgets the 1 / (1 - p) rescale is 10 % low). The mean's sampling noise, measured on CPU: 1 % at seq 64, 0.3 % at
128, 0.1 % at 512.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pretrain.data.unpadded import bucketed
from pretrain.device_check.run_shape import RunShape
from pretrain.model.varlen_attention import VarlenKernel, reference_varlen_attention

LIMIT_EPS = 0.8  # the limit in units of the dtype's machine epsilon (module docstring)
FP32_FLOOR = 1e-5  # another fp32 kernel may sum in another order
HEADS = 2
DROPOUT = 0.1  # BERT's attention_probs_dropout_prob
DROPOUT_MEAN = 0.03  # the mean output with dropout may differ this much (relative) from the one without
PARTS = ("output", "dq", "dk", "dv")


@dataclass(frozen=True)
class KernelCase:
    """One micro-batch of the kernel stage: where its segments are, and how many of its tokens are real."""

    cu_seqlens: torch.Tensor  # [segments + 1] int32, the bucket tail as the last segment (maybe empty)
    real: int  # tokens before the bucket tail
    max_seqlen: int


def kernel_limit(dtype: torch.dtype) -> float:
    """The relative error a correct kernel stays within in `dtype` (module docstring)."""
    return max(LIMIT_EPS * torch.finfo(dtype).eps, FP32_FLOOR)


def kernel_case(lengths: list[int], seq_len: int) -> KernelCase:
    """The segments of instances of `lengths` as the unpadded collator lays them out (pretrain/data/unpadded.py):
    the bucket tail is a segment of its own, empty when the instances fill the bucket exactly."""
    total = sum(lengths)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist(), bucketed(total, seq_len)]
    return KernelCase(torch.tensor(bounds, dtype=torch.int32), total, seq_len)


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 matmuls in full fp32 (TF32 off) while the reference runs; the run's setting restored after.

    Through torch's fp32_precision settings ("ieee": no TF32), not the legacy allow_tf32 flags: a process that set
    TF32 the new way (`torch.backends.fp32_precision = "tf32"`, what transformers' enable_tf32 does on torch >= 2.9)
    makes torch 2.13 raise on any read of a legacy flag ("mix of the legacy and new APIs"), which failed the self-test
    in such a process (and in its spawned child, which re-imports the user's script). The new settings take the
    legacy ones into account when unset ("none"), and restoring "none" leaves a legacy-flag process as it was."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.fp32_precision, cudnn.fp32_precision
    matmul.fp32_precision = cudnn.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision, cudnn.fp32_precision = saved


def forward_backward(kernel: VarlenKernel, inputs: list[torch.Tensor], case: KernelCase,
                     dtype: torch.dtype) -> list[torch.Tensor]:
    """[output, dq, dk, dv] of `kernel` on the real tokens, in fp32, computed in `dtype`; inputs[3]: the gradient
    into the output (zero on the bucket tail, which nothing reads)."""
    q, k, v = (x.detach().to(dtype, copy=True).requires_grad_() for x in inputs[:3])
    head_dim = q.size(-1)
    out = kernel(q, k, v, case.cu_seqlens.to(q.device), case.max_seqlen, 0.0, head_dim**-0.5)
    out.backward(inputs[3].to(dtype))
    return [t.detach()[: case.real].float() for t in (out, q.grad, k.grad, v.grad)]


def case_inputs(case: KernelCase, head_dim: int, dtype: torch.dtype, device: torch.device,
                seed: int, heads: int = HEADS) -> list[torch.Tensor]:
    """q, k, v and the output's gradient, standard normal, rounded to `dtype` (the same values for both sides)."""
    tokens = int(case.cu_seqlens[-1])
    generator = torch.Generator().manual_seed(seed)
    drawn = [torch.randn(tokens, heads, head_dim, generator=generator) for _ in range(4)]
    drawn[3][case.real:] = 0
    return [x.to(dtype).float().to(device) for x in drawn]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error; NaN stays NaN (a failed verdict)."""
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def kernel_error(device: torch.device, dtype: torch.dtype, head_dim: int, batches: list[list[int]],
                 kernel: VarlenKernel, run: RunShape | None = None) -> dict[str, float]:
    """{"output" | "dq" | "dk" | "dv": the worst relative error over `batches`} of `kernel` in `dtype` against the
    fp32 reference on the same rounded inputs. `batches`: instance lengths of each micro-batch at seq_len
    max(lengths) (self_test.edge_case_lengths), HEADS heads each; `run`: one more case, the run's micro-batch of
    instances with the run's head count (a kernel path taken only past some segment or head count is seen)."""
    seq_len = max(max(lengths) for lengths in batches)
    cases = [(lengths, HEADS) for lengths in batches]
    if run is not None:
        cases.append((list(run.lengths), run.heads))
    worst = dict.fromkeys(PARTS, 0.0)
    for seed, (lengths, heads) in enumerate(cases):
        case = kernel_case(lengths, seq_len)
        inputs = case_inputs(case, head_dim, dtype, device, seed, heads)
        with exact_fp32():
            want = forward_backward(reference_varlen_attention, inputs, case, torch.float32)
        got = forward_backward(kernel, inputs, case, dtype)
        for name, g, w in zip(PARTS, got, want, strict=True):
            error = relative(g, w)
            worst[name] = math.inf if math.isnan(error) else max(worst[name], error)
    return worst


def dropout_problem(device: torch.device, dtype: torch.dtype, head_dim: int, lengths: list[int],
                    kernel: VarlenKernel) -> str | None:
    """Why `kernel` at DROPOUT looks wrong on one micro-batch of `lengths` (module docstring); None: it does not.
    Seeds the global RNG: the caller forks it (self_test.kernel_self_test does)."""
    case = kernel_case(lengths, max(lengths))
    q, k, v, grad = case_inputs(case, head_dim, dtype, device, seed=len(lengths))
    runs = []
    for dropout in (0.0, DROPOUT):
        torch.manual_seed(0)
        leaves = [x.detach().to(dtype, copy=True).requires_grad_() for x in (q, k, v + 1)]
        out = kernel(*leaves, case.cu_seqlens.to(device), case.max_seqlen, dropout, head_dim**-0.5)
        out.backward(grad.to(dtype))
        runs.append([t.detach()[: case.real].float() for t in (out, *(x.grad for x in leaves))])
    (plain, dropped) = runs
    if not all(bool(t.isfinite().all()) for t in dropped):
        return f"attention dropout {DROPOUT} gave non-finite outputs or gradients"
    if all(torch.equal(a, b) for a, b in zip(plain, dropped, strict=True)):
        return f"attention dropout {DROPOUT} changed neither the output nor the gradients"
    shift = float(dropped[0].mean() / plain[0].mean()) - 1
    if abs(shift) > DROPOUT_MEAN:
        return (f"attention dropout {DROPOUT} moved the mean output by {100 * shift:+.1f} % (limit "
                f"{100 * DROPOUT_MEAN:.0f} %: inverted dropout keeps it)")
    return None
