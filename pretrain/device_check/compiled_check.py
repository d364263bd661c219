"""The self-test of the compiled layer: the graph the run compiles, at the run's shapes, checked before training.

Why: the kernel self-test (pretrain/device_check/unpadded_check.py) runs the layer eager, so a compiled run's first execution
of inductor's code (its Triton kernels around the flash call, chosen for the real width; its dropout code) would be
the run itself, and a wrong kernel there would train silently. So one encoder layer (transformers' BertLayer) is
built at the run's hidden size, heads, intermediate size and dropout (pretrain/device_check/run_shape.py) and run, forward
and backward, on one micro-batch of the run's instances, three ways on the same weights and the same rounded
inputs: in fp32 eager (the reference, TF32 off), eager in the run's dtype, and through a `CompiledLayer` (the run's
backend) in the run's dtype.

Accuracy, dropout off (the same graph but for its dropout): the compiled layer's relative error against fp32, for
the layer's output and for every gradient (the input's and the parameters', as one vector), must stay within
LAYER_SLACK x the eager layer's own error in the dtype, plus a small floor. The eager layer is what the compiled one
replaces, so its error is the noise a correct compiled layer may have: in bf16 at seq 512 the eager layer is 9.1e-3
off fp32 and a correct inductor layer 8.9e-3 (it keeps fused intermediates in fp32), while a layer 1 % off is at
1.3e-2 and one 2 % off at 2.2e-2 (measured on CPU). The whole-model limit the first version reused (4x the padded
path's error through a model) passed a layer 2 % off.

Dropout, the run's rates (no reference: inductor draws its own masks, so no element can be compared): the compiled
layer's outputs and gradients are finite, and their distance from the same layer without dropout (its dropout
noise) is within DROPOUT_NOISE of the eager layer's, drawn the same way: a compiled graph that drops nothing, drops
at another rate or forgets the 1/(1-p) rescale moves that distance (measured: none of the hidden dropout 0.6x,
twice its rate 1.25-1.3x). It runs when the accuracy check passed (a layer already wrong fails on that).

A layer that falls back instead of compiling fails with the fallback's reason (the run would fall back the same
way, with the same line); an error fails with its own. Cost: two compiles of one layer (with and without dropout)
at the run's width (seconds to tens of seconds with inductor); the run plan's `settle_attention`
(pretrain/plan/run_plan.py) calls it where a phase compiles its layers; the tests pass a backend with no code
generation and a small width.
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Any

import torch
from transformers.models.bert.modeling_bert import BertLayer

from pretrain.device_check.kernel_check import exact_fp32, kernel_case
from pretrain.device_check.run_shape import RunShape
from pretrain.device_check.unpadded_check import DTYPES, INIT_SCALE, VOCAB, edge_case_lengths, relative
from pretrain.device_check.verdict import SelfTestResult, over
from pretrain.model.bert import bert_config
from pretrain.model.compiled import CompiledLayer, ignore
from pretrain.model.unpadded import LayerForward, encoder_layer, unpadded_layer
from pretrain.model.varlen_attention import VarlenKernel, reference_varlen_attention, varlen_attention

LAYER_SLACK = 1.3  # the compiled layer's error against fp32 may be this many times the eager layer's
LAYER_FLOOR = {"fp32": 1e-5, "bf16": 5e-4, "fp16": 1e-4}  # besides: another summation order, a fused rounding
DROPOUT_NOISE = 0.15  # the compiled layer's dropout noise may differ this much (relative) from the eager layer's
Outputs = tuple[torch.Tensor, torch.Tensor]  # the layer's output and all its gradients, flat, in fp32


def default_shape(head_dim: int, seq_len: int) -> RunShape:
    """What a caller without a run checks: 2 heads of `head_dim`, BERT's dropout, the edge cases' first batch."""
    return RunShape(heads=2, hidden=2 * head_dim, intermediate=8 * head_dim, attention_dropout=0.1,
                    hidden_dropout=0.1, lengths=tuple(edge_case_lengths(seq_len)[0]))


def run_layer(shape: RunShape, seq_len: int, dropout: bool) -> BertLayer:
    """One encoder layer of the run's shape in fp32, train mode, weights from a fixed seed (drawn at INIT_SCALE /
    sqrt(hidden), as the self-test's model: attention then moves the output, so a wrong attention shows);
    `dropout` False: the same layer with every dropout rate 0."""
    rates = (shape.attention_dropout, shape.hidden_dropout) if dropout else (0.0, 0.0)
    config = bert_config("tiny", VOCAB, seq_len, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                         num_hidden_layers=1, intermediate_size=shape.intermediate,
                         attention_probs_dropout_prob=rates[0], hidden_dropout_prob=rates[1])
    torch.manual_seed(0)
    layer = BertLayer(config)
    with torch.no_grad():
        for parameter in layer.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, INIT_SCALE / shape.hidden**0.5)
    return layer.train()


def forward_backward(function: LayerForward, layer: BertLayer, inputs: list[torch.Tensor], cu_seqlens: torch.Tensor,
                     seq_len: int, seed: int = 0) -> Outputs:
    """(output, [input grad, every parameter's grad]) of one call in the layer's dtype, flat and in fp32."""
    dtype = next(layer.parameters()).dtype
    hidden = inputs[0].detach().to(dtype, copy=True).requires_grad_()
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = function(layer, hidden, cu_seqlens, seq_len)
    out.backward(inputs[1].to(dtype))
    grads = [hidden.grad, *(p.grad for p in layer.parameters())]
    return out.detach().float().flatten(), torch.cat([g.detach().float().flatten() for g in grads])


def dropout_problem(compiled: Outputs, eager: Outputs, plain: Outputs) -> str | None:
    """Why the compiled layer's dropout looks wrong next to the eager layer's (module docstring); None: it does
    not. `plain`: the eager layer without dropout, in the same dtype."""
    if not all(bool(t.isfinite().all()) for t in compiled):
        return "the compiled layer with dropout gave non-finite outputs or gradients"
    for name, got, want, base in zip(("output", "gradients"), compiled, eager, plain, strict=True):
        noise, expected = relative(got, base), relative(want, base)
        if abs(noise / max(expected, 1e-30) - 1) > DROPOUT_NOISE:
            return (f"the compiled layer's dropout moved its {name} by {noise:.2e} from the layer without dropout, the "
                    f"eager layer's by {expected:.2e} (limit {100 * DROPOUT_NOISE:.0f} % apart)")
    return None


def check_layer(device: torch.device, precision: str, shape: RunShape, seq_len: int,
                compiled: LayerForward) -> tuple[dict[str, tuple[float, float]], str | None]:
    """({"output" | "grads": (compiled error, limit)}, the dropout problem or None), per the module docstring: the
    reference is the eager layer with the reference kernel in fp32, the noise the eager layer with the device's
    kernel (the kernel stage passed it) in the dtype."""
    reference = functools.partial(unpadded_layer, kernel=reference_varlen_attention)
    eager = unpadded_layer
    dtype = DTYPES[precision]
    cu_seqlens = kernel_case(list(shape.lengths), seq_len).cu_seqlens.to(device)
    generator = torch.Generator().manual_seed(0)
    tokens = int(cu_seqlens[-1])
    inputs = [torch.randn(1, tokens, shape.hidden, generator=generator).to(dtype).float().to(device) for _ in "xg"]
    plain = run_layer(shape, seq_len, dropout=False).to(device)
    with exact_fp32():
        want = forward_backward(reference, plain, inputs, cu_seqlens, seq_len)
    plain.to(dtype)
    noise = forward_backward(eager, plain, inputs, cu_seqlens, seq_len)
    got = forward_backward(compiled, copy.deepcopy(plain), inputs, cu_seqlens, seq_len)
    worst = {}
    for index, name in enumerate(("output", "grads")):
        limit = LAYER_SLACK * relative(noise[index], want[index]) + LAYER_FLOOR[precision]
        worst[name] = (relative(got[index], want[index]), limit)
    if not (shape.attention_dropout or shape.hidden_dropout) or any(over(*pair) > 1 for pair in worst.values()):
        return worst, None  # no dropout; or a layer already wrong without it (its dropout noise says nothing more)
    dropped = run_layer(shape, seq_len, dropout=True).to(device, dtype)
    eager_dropped = forward_backward(eager, dropped, inputs, cu_seqlens, seq_len, seed=1)
    compiled_dropped = forward_backward(compiled, copy.deepcopy(dropped), inputs, cu_seqlens, seq_len, seed=1)
    return worst, dropout_problem(compiled_dropped, eager_dropped, noise)


def compiled_self_test(device: torch.device, precision: str, head_dim: int, seq_len: int = 128,
                       shape: RunShape | None = None, backend: Any = "inductor",
                       kernel: VarlenKernel = varlen_attention) -> SelfTestResult:
    """The compiled layer at `shape` (the run's; None: `default_shape`) on `device` in `precision` (module
    docstring); never raises for the compiler's sake: a fallback or an error is a failed verdict. `kernel`: the
    kernel inside the compiled layer (the tests' seam for wrong code around it; the eager layers run the device's).
    The global RNG is left as it was."""
    shape = shape or default_shape(head_dim, seq_len)
    where = f"{device} {precision} compiled layer ({shape.words()})"
    started = time.perf_counter()
    layer = CompiledLayer(functools.partial(unpadded_layer, kernel=kernel), strict=False, say=ignore, backend=backend)
    compiled = functools.partial(encoder_layer, layer)  # as the encoder calls it: again, eager, after a fallback
    words = {"output_name": "output", "subject": "the compiled layer"}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            worst, dropout = check_layer(device, precision, shape, seq_len, compiled)
        except Exception as error:  # noqa: BLE001 - code the compiler generated that this device cannot run
            first = (str(error).strip().splitlines() or [""])[0][:200]
            return SelfTestResult(False, where, seconds=time.perf_counter() - started,
                                  failure=f"{type(error).__name__}: {first}", **words)
    problems = [f"the compiled layer fell back: {layer.fallback}"] if layer.fallback is not None else []
    problems += [dropout] if dropout is not None else []
    passed = all(over(*pair) <= 1 for pair in worst.values()) and not problems
    return SelfTestResult(passed, where, *worst["output"], *worst["grads"], time.perf_counter() - started,
                          problem="; ".join(problems) or None, **words)
