"""Regionally compiled unpadded layers (the few compiled tests of the suite: compiling costs ~20 s on CPU).

One compile of the tiny model as the recipes build it (the driver's `prepare_model_path`, model.compile on):
batches of three token counts and two instance counts through forward and backward, each equal to the
padded eager reference, with 0 graph breaks and no recompile; the state dict keeps the eager keys.
"""

from __future__ import annotations

import pytest
import torch
from transformers import BertForPreTraining

from pretrain.config.attention import attention_plan
from pretrain.config.sections import RunConfig
from pretrain.data.batches import PhaseData
from pretrain.model.compiled import compile_metrics, compiled_layer, graph_breaks
from pretrain.model.kernel_support import DeviceFacts
from pretrain.model.setup import prepare_model_path
from tests.support.model_fixtures import both_layouts, forward_and_grads, no_dropout_model

CPU_FP32 = {"bf16": {"enabled": False}, "fp16": {"enabled": False}, "zero_optimization": {"stage": 2}}


def compiled_model(vocab_size: int, activation_checkpointing: bool = False) -> torch.nn.Module:
    config = RunConfig()
    config.model.compile = True
    model = no_dropout_model(vocab_size)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the phase's attention plan as the run plan makes it, then the driver's rank-side set-up
    plan = attention_plan(config, "phase1", CPU_FP32, DeviceFacts("cpu"), 32)
    assert plan.unpadded and plan.compile and plan.compile_strict
    prepare_model_path(model, plan)
    assert compiled_layer(model) is not None
    return model


def test_compiled_layers_train_like_padded_eager_with_no_graph_break_or_recompile(data: PhaseData) -> None:
    torch._dynamo.reset()
    breaks_before = graph_breaks()
    model = compiled_model(data.vocab.size)
    reference = no_dropout_model(data.vocab.size)
    for lengths in ([32, 7, 19, 3, 31], [3, 4, 5, 6, 3, 9, 4, 5, 3, 8, 3, 4], [30, 30, 30, 30, 30]):
        padded, unpadded = both_layouts(data, lengths)
        want, want_grads = forward_and_grads(reference, padded)
        got, got_grads = forward_and_grads(model, unpadded)
        for key in ("loss", "mlm_logits", "nsp_logits"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == want_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    assert graph_breaks() == breaks_before == 0
    assert compiled_layer(model).graphs == 1  # one graph for every layer, token count and instance count
    metrics = compile_metrics(model)
    assert metrics["compile/graph_breaks"] == 0 and metrics["compile/recompiles"] == 0
    assert metrics["compile/fallback"] == metrics["compile/recompile_limit"] == 0
    assert metrics["compile/seconds"] > 0
    assert list(model.state_dict()) == list(BertForPreTraining(model.config).state_dict())  # no _orig_mod.


def test_compiled_layers_under_activation_checkpointing_have_no_graph_break(data: PhaseData) -> None:
    model = compiled_model(data.vocab.size, activation_checkpointing=True)
    reference = no_dropout_model(data.vocab.size)
    padded, unpadded = both_layouts(data, [32, 7, 19, 3, 31])
    _, want = forward_and_grads(reference, padded)
    _, got = forward_and_grads(model, unpadded)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
    assert graph_breaks() == 0


@pytest.mark.parametrize("attention, compile, precision, stage, expected", [
    ("unpadded", None, "fp32", 1, "needs bf16 or fp16 on CUDA, phase1 computes in fp32 (run.precision); "
     "model.attention=padded runs there"),
    ("auto", True, "bf16", 3, "model.compile: compiled layers are not supported with ZeRO-3"),
    ("auto", None, "fp32", 1, None),  # auto runs padded there; null compile stays off under ZeRO-3
    ("auto", None, "bf16", 3, None),
])
def test_setups_the_kernel_cannot_run_are_refused_in_one_line(attention: str, compile: bool | None, precision: str,
                                                              stage: int, expected: str | None) -> None:
    """The launch preflight's check (no torch, no device): explicit choices that cannot run, in one line."""
    from pretrain.config.attention import setup_problem

    config = RunConfig()
    config.model.attention, config.model.compile = attention, compile
    ds = {"bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": False}, "zero_optimization": {"stage": stage}}
    problem = setup_problem(config, "phase1", ds, "cuda")
    assert problem == expected if expected is None else (expected in problem and "\n" not in problem)
    config.model.attention, config.model.compile = "padded", None
    assert setup_problem(config, "phase1", ds, "cuda") is None


def test_the_cuda_flash_call_traces_in_one_graph_with_its_backward_on_meta_tensors() -> None:
    """No GPU here: the CUDA branch (aten._flash_attention_forward with cu_seqlens, bf16, dropout 0.1) is traced
    by dynamo in one graph (fullgraph) on meta tensors, with shapes, dtype and a backward as the kernel has them."""
    from pretrain.model.varlen_attention import flash_varlen_attention

    q, k, v = (torch.empty(96, 4, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu_seqlens = torch.empty(7, dtype=torch.int32, device="meta")
    traced = torch.compile(flash_varlen_attention, backend="aot_eager", fullgraph=True)
    out = traced(q, k, v, cu_seqlens, 128, 0.1, 0.125)
    assert (out.shape, out.dtype) == ((96, 4, 64), torch.bfloat16)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and k.grad is not None and v.grad is not None
