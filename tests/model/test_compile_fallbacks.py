"""Compile failures caught where they happen, with their cause (pretrain/model/compiled.py): a backend that cannot
compile the backward graph, compiled code that raises on its first run and a backend that raises in forward each
give the same one line and an eager layer under the default (loss.backward() runs), a one-line refusal under
model.compile=true; the line quotes the root of the error's chain. Per process (a CompileLedger shared by the
phases): the fallback is said and recorded once and holds in the next phase; phase 2's recompile for its new
max_seqlen counts. Failures are planted with custom backends (no inductor: it costs tens of seconds on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from pretrain.data.batches import PhaseData
from pretrain.errors import ConfigError
from pretrain.model.compiled import CompiledLayer, CompileLedger, amend_resolved, compile_metrics
from pretrain.model.unpadded import LAYER_FORWARD_ATTRIBUTE
from tests.support.model_fixtures import both_layouts, forward_and_grads, no_dropout_model

Backend = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]


class OutOfResources(Exception):
    """Shaped like Triton's launch error (triton.runtime.errors.OutOfResources): neither RuntimeError nor dynamo's."""


def boxed(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
    return make_boxed_func(gm.forward)


def failing_backward(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
    raise RuntimeError("planted: the backward graph does not compile\n(a second line)")


def raising_at_launch(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
    def run(_args: list[Any]) -> Any:
        raise OutOfResources("out of resource: shared memory, Required: 232448, Hardware limit: 101376")

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def no_compiler(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
    raise RuntimeError("\nplanted: Cannot find a working triton installation")


PLANTS: dict[str, tuple[Backend, str]] = {
    "backward": (aot_autograd(fw_compiler=boxed, bw_compiler=failing_backward),
                 "could not compile or run its backward graph ("),
    "launch": (aot_autograd(fw_compiler=raising_at_launch, bw_compiler=boxed),
               "failed when its compiled code first ran (OutOfResources: out of resource: shared memory, Required: "
               "232448, Hardware limit: 101376)"),
    "forward": (no_compiler, "could not be compiled (BackendCompilerFailed: backend='no_compiler' raised: "
                             "RuntimeError: planted: Cannot find a working triton installation"),
}


def test_each_planted_failure_falls_back_in_one_line_with_its_cause_or_is_refused(data: PhaseData) -> None:
    torch._dynamo.reset()
    model = no_dropout_model(data.vocab.size)
    _, batch = both_layouts(data, [32, 7, 19])
    want_loss, want_grads = forward_and_grads(model, batch)
    for name, (backend, words) in PLANTS.items():
        said: list[str] = []
        setattr(model, LAYER_FORWARD_ATTRIBUTE, CompiledLayer(say=said.append, backend=backend))
        got_loss, got_grads = forward_and_grads(model, batch)  # loss.backward() runs: no crash
        torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
        torch.testing.assert_close(got_grads, want_grads, rtol=0, atol=0)
        (line,) = said
        assert line.startswith(f"compile: the encoder layer {words}") and "\n" not in line, (name, line)
        assert line.endswith("it runs eager from here (compile/fallback=1; model.compile=false skips compiling)")
        if name == "backward":
            assert "RuntimeError: planted: the backward graph does not compile" in line, line
        assert compile_metrics(model)["compile/fallback"] == 1.0
        setattr(model, LAYER_FORWARD_ATTRIBUTE, CompiledLayer(strict=True, say=said.append, backend=backend))
        with pytest.raises(ConfigError) as refused:
            forward_and_grads(model, batch)
        message = str(refused.value)
        assert message.startswith(f"model.compile=true: the encoder layer {words}") and "\n" not in message
        assert message.endswith("model.compile=null runs it eager with a warning, false never compiles it")
        torch._dynamo.reset()  # the next plant compiles afresh


def test_a_fallback_is_said_and_recorded_once_per_process_and_recompiles_count_over_phases(data: PhaseData) -> None:
    torch._dynamo.reset()
    _, batch = both_layouts(data, [32, 7, 19])
    longer = {**batch, "max_seqlen": 2 * batch["max_seqlen"]}  # phase 2: a new max_seqlen, a recompile
    ledger = CompileLedger()
    phases = []
    for phase_batch in (batch, longer):  # each phase: a new model and a new layer, the process's ledger
        model = no_dropout_model(data.vocab.size)
        setattr(model, LAYER_FORWARD_ATTRIBUTE, CompiledLayer(say=print, backend="eager", ledger=ledger))
        forward_and_grads(model, phase_batch)
        forward_and_grads(model, phase_batch)
        phases.append(compile_metrics(model)["compile/recompiles"])
    assert phases == [0.0, 1.0] and ledger.graphs == 2  # the probe's backward compiles no graph of its own

    torch._dynamo.reset()
    said: list[str] = []
    records: list[str] = []
    failed = CompileLedger(on_fallback=records.append)
    for _phase in range(2):
        model = no_dropout_model(data.vocab.size)
        setattr(model, LAYER_FORWARD_ATTRIBUTE, CompiledLayer(say=said.append, backend=no_compiler, ledger=failed))
        forward_and_grads(model, batch)
        assert compile_metrics(model)["compile/fallback"] == 1.0
    assert len(said) == 1 and len(records) == 1 and failed.graphs == 0  # phase 2 never retried
    resolved = {"resolved": {"world_size": 1, "attention": {
        "phase1": {"path": "unpadded", "compile": True, "why": "w"}, "phase2": {"path": "padded", "compile": False}}}}
    amended = amend_resolved(resolved, records[0])["resolved"]
    assert amended["world_size"] == 1 and amended["attention"]["phase2"] == {"path": "padded", "compile": False}
    assert amended["attention"]["phase1"]["compile"] is False
    assert amended["attention"]["phase1"]["compile_why"].startswith(
        "the encoder layer runs eager: BackendCompilerFailed: backend='no_compiler' raised: RuntimeError: planted")
