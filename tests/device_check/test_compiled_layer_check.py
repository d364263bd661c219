"""The compiled-layer self-test checks the graph the run compiles (pretrain/device_check/compiled_check.py): one encoder
layer at the run's width, heads and dropout, against the eager layer's own error in the dtype. Planted: a compiled
layer 2 % off in bf16 (which the whole-model check of the first version passed: its limit was 4x a model's bf16
noise), a compiled graph whose dropout drops nothing or twice the rate; the correct layer passes. Width 128 with 4
heads and a micro-batch of 8 instances at seq 64 (512 tokens), not a run's 768-1024 (the product check uses the
run's; the CPU cost here is seconds). Backends without code generation (inductor costs tens of seconds)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from pretrain.device_check.compiled_check import compiled_self_test
from pretrain.device_check.run_shape import RunShape, micro_batch_lengths, run_shape
from tests.support.model_fixtures import no_dropout_model

CPU = torch.device("cpu")
SEQ = 64
SHAPE = RunShape(heads=4, hidden=128, intermediate=512, attention_dropout=0.1, hidden_dropout=0.1,
                 lengths=micro_batch_lengths(SEQ, 8))


def scaled(factor: float) -> Callable[..., Any]:
    """A backend whose code computes the layer `factor` times too large (its gradients too)."""
    def backend(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            return tuple(out * factor for out in gm(*args))

        return run

    return backend


def dropout_rate_times(factor: float) -> Callable[..., Any]:
    """A backend whose code drops at `factor` times the layer's hidden dropout rate (0: drops nothing there)."""
    def backend(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
        for node in list(gm.graph.nodes):
            if node.target is torch.nn.functional.dropout:
                rate = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else None)
                with gm.graph.inserting_before(node):
                    planted = gm.graph.call_function(operator.mul, (rate, factor))
                if "p" in node.kwargs:
                    node.kwargs = {**node.kwargs, "p": planted}
                else:
                    node.args = (node.args[0], planted, *node.args[2:])
        gm.recompile()
        return gm.forward

    return backend


def check(backend: Any, precision: str = "bf16") -> Any:
    torch._dynamo.reset()
    return compiled_self_test(CPU, precision, SHAPE.head_dim, SEQ, SHAPE, backend=backend)


def test_a_compiled_layer_two_percent_off_in_bf16_fails_and_the_correct_one_passes() -> None:
    correct = check("eager")
    assert correct.passed, correct.numbers()
    assert correct.numbers().startswith("cpu bf16 compiled layer (hidden 128, 4 heads, dropout 0.1/0.1, 8 "
                                        "instances): output error ")
    assert correct.logits_error < correct.logits_limit / 1.2  # the limit is 1.3x eager's own error
    off = check(scaled(1.02))
    assert not off.passed and off.logits_error > 1.5 * off.logits_limit, off.numbers()
    assert "compiled layer (hidden 128, 4 heads, dropout 0.1/0.1, 8 instances): output error " in off.numbers()
    assert " is over its limit " in off.numbers().split(";")[0]  # the reason before the numbers


def test_a_compiled_graph_whose_dropout_drops_nothing_or_twice_the_rate_fails() -> None:
    """(The plant at factor 1 passes: it is the correct layer, tested above with the plain backend.)"""
    for factor in (0.0, 2.0):
        wrong = check(dropout_rate_times(factor))
        assert not wrong.passed and wrong.problem is not None, (factor, wrong.numbers())
        assert wrong.problem.startswith("the compiled layer's dropout moved its output by "), wrong.problem
        assert wrong.logits_error <= wrong.logits_limit  # its dropout-free accuracy passes: dropout alone failed


def test_the_run_shape_is_the_phase_models_and_its_micro_batch() -> None:
    config = no_dropout_model(128, hidden_size=96, num_attention_heads=3, intermediate_size=200).config
    shape = run_shape(config, [(512, 16), (128, 64)])  # the phase with the most instances per micro-batch
    assert (shape.heads, shape.hidden, shape.intermediate, shape.head_dim) == (3, 96, 200, 32)
    assert shape.attention_dropout == shape.hidden_dropout == 0.0
    assert len(shape.lengths) == 64 and max(shape.lengths) == 128 and min(shape.lengths) >= 32
