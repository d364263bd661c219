"""Compile that fails in one clear way (pretrain/model/compiled.py): a graph break planted inside the layer is an
error at its first call, which the default (model.compile null) turns into one line, compile/fallback and an eager
layer, and an explicit model.compile=true into a ConfigError (exit 2); a shape specialization is a recompile,
never a crash; torch's recompile limit is a line and compile/recompile_limit. Then the private torch names the
module reads, each guarded with what changed. backend="eager": dynamo's tracing is under test, not codegen."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException, Unsupported
from torch._dynamo.utils import compilation_time_metrics, counters

from pretrain.data.batches import PhaseData
from pretrain.errors import ConfigError
from pretrain.model.compiled import COMPILE_TIME, CompiledLayer, compile_metrics
from pretrain.model.unpadded import LAYER_FORWARD_ATTRIBUTE, unpadded_layer
from pretrain.model.varlen_attention import reference_varlen_attention
from tests.support.model_fixtures import both_layouts, no_dropout_model


def branching_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     dropout: float, scale: float) -> torch.Tensor:
    """The reference kernel behind a data-dependent branch: a graph break dynamo cannot trace through."""
    if cu_seqlens[-1] > 0:
        return reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    return q


def specializing_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                        dropout: float, scale: float) -> torch.Tensor:
    """The reference kernel behind a branch on the token count: the dynamic token dimension gets specialized."""
    out = reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    return out * 1.0 if q.size(0) == 64 else out


def run(model: torch.nn.Module, layer: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The loss with `layer` as the model's layer function (None: eager)."""
    setattr(model, LAYER_FORWARD_ATTRIBUTE, layer)
    return model(**batch).loss.detach()


def test_a_graph_break_inside_the_layer_falls_back_by_default_and_is_refused_when_compile_is_true(
        data: PhaseData) -> None:
    model = no_dropout_model(data.vocab.size)
    _, batch = both_layouts(data, [32, 7, 19])
    eager = run(model, None, batch)
    said: list[str] = []
    planted = functools.partial(unpadded_layer, kernel=branching_kernel)
    layer = CompiledLayer(planted, strict=False, say=said.append, backend="eager")
    torch.testing.assert_close(run(model, layer, batch), eager, rtol=0, atol=0)  # the same step, eager
    (line,) = said
    assert line.startswith("compile: the encoder layer does not compile as one graph (Unsupported: Data-dependent "
                           "branching at test_compile_failures.py:") and "in branching_kernel (if cu_seqlens[-1] > 0:)" in line
    assert line.endswith("it runs eager from here (compile/fallback=1; model.compile=false skips compiling)")
    run(model, layer, batch)
    assert len(said) == 1 and compile_metrics(model)["compile/fallback"] == 1.0  # said once; the metric stays
    strict = CompiledLayer(planted, strict=True, say=said.append, backend="eager")
    with pytest.raises(ConfigError) as refused:
        run(model, strict, batch)
    message = str(refused.value)
    assert message.startswith("model.compile=true: the encoder layer does not compile as one graph (Unsupported: "
                              "Data-dependent branching at test_compile_failures.py:") and "\n" not in message
    assert message.endswith("model.compile=null runs it eager with a warning, false never compiles it")


def test_a_specialized_shape_recompiles_and_the_recompile_limit_says_so(data: PhaseData) -> None:
    """maybe_mark_dynamic: code that needs the token count static gets a graph per value, no ConstraintViolationError
    (mark_dynamic's crash); past the limit, one line and compile/recompile_limit, then eager, the same losses."""
    torch._dynamo.reset()  # the layer's graph count from 0, whatever earlier tests compiled
    model = no_dropout_model(data.vocab.size)
    batches = [both_layouts(data, lengths)[1] for lengths in ([30, 20], [30, 30, 30, 9], [32, 32, 32, 32, 32])]
    assert [b["input_ids"].numel() for b in batches] == [64, 128, 160]
    eager = [run(model, None, b) for b in batches]
    said: list[str] = []
    layer = CompiledLayer(functools.partial(unpadded_layer, kernel=specializing_kernel), say=said.append,
                          backend="eager")
    for batch, want in zip(batches, eager, strict=True):
        torch.testing.assert_close(run(model, layer, batch), want, rtol=1e-6, atol=1e-6)
    assert layer.graphs >= 2 and not said and layer.fallback is None  # recompiled, nothing said, still compiled
    with torch._dynamo.config.patch(recompile_limit=1):
        limited = CompiledLayer(say=said.append, backend="eager")
        torch.testing.assert_close(run(model, limited, batches[0]), eager[0], rtol=1e-6, atol=1e-6)
        model.double()  # another dtype: a second graph, past a limit of 1
        run(model, limited, {k: v for k, v in batches[0].items()})
    (line,) = said
    assert line.startswith("compile: the encoder layer reached torch's recompile limit (1 graphs, "
                           "torch._dynamo.config.recompile_limit=1); it runs eager from here (compile/recompile_limit=1")
    metrics = compile_metrics(model)
    assert metrics["compile/recompile_limit"] == metrics["compile/fallback"] == 1.0
    assert metrics["compile/recompiles"] == 0.0  # one graph compiled; the second was refused by the limit


def test_the_private_torch_names_the_compile_counters_read_still_mean_what_they_did() -> None:
    """pretrain/model/compiled.py reads these private parts of torch 2.13; if one fails, it says what changed."""
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    graphs = counters["stats"]["unique_graphs"]
    full = torch.compile(double, fullgraph=True, backend="eager")
    full(torch.ones(3))
    full(torch.ones(3, dtype=torch.float64))
    assert counters["stats"]["unique_graphs"] - graphs == 2, \
        "torch._dynamo.utils.counters['stats']['unique_graphs'] no longer counts each compiled graph (compile/recompiles)"
    assert COMPILE_TIME in compilation_time_metrics, \
        f"torch._dynamo.utils.compilation_time_metrics has no {COMPILE_TIME!r} any more (compile/seconds)"

    def breaks(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x + 1

    saved = dict(counters["graph_break"])  # process-wide, survives torch._dynamo.reset(): restored for other tests
    try:
        torch.compile(breaks, backend="eager")(torch.ones(2))
        assert sum(counters["graph_break"].values()) > sum(saved.values()), \
            "torch._dynamo.utils.counters['graph_break'] no longer counts graph breaks (compile/graph_breaks)"
    finally:
        counters["graph_break"].clear()
        counters["graph_break"].update(saved)
    def breaks_again(x: torch.Tensor) -> torch.Tensor:  # another code object: dynamo caches per code object
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(TorchDynamoException) as broken:
        torch.compile(breaks_again, fullgraph=True, backend="eager")(torch.ones(2))
    assert isinstance(broken.value, Unsupported), \
        "a graph break under fullgraph=True no longer raises torch._dynamo.exc.Unsupported (CompiledLayer's fallback)"
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(FailOnRecompileLimitHit):
        limited = torch.compile(lambda x: x - 1, fullgraph=True, backend="eager")
        limited(torch.ones(2))
        limited(torch.ones(2, dtype=torch.float64))  # the recompile limit under fullgraph: an exception, not eager
