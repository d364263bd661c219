"""Every rank says its own compile fallback (pretrain/model/setup.py, pretrain/model/compiled.py): a fallback is one
process's (one rank can fall back while the others compile, and the job then runs at its eager pace), so the
line names the rank and its host, and a rank other than 0 says it too (before, its `say` was a no-op)."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import pytest
import torch

from pretrain.config.attention import attention_plan
from pretrain.config.sections import RunConfig
from pretrain.data.batches import PhaseData
from pretrain.model.compiled import CompiledLayer, compiled_layer
from pretrain.model.kernel_support import DeviceFacts
from pretrain.model.setup import prepare_model_path, say_now
from pretrain.model.unpadded import LAYER_FORWARD_ATTRIBUTE
from tests.support.model_fixtures import both_layouts, no_dropout_model

CPU_FP32 = {"bf16": {"enabled": False}, "fp16": {"enabled": False}, "zero_optimization": {"stage": 2}}


@pytest.fixture(autouse=True)
def fresh_code_cache() -> Any:
    """Each test leaves torch's code cache as it found it (empty): later tests count the layer's graphs from 0."""
    yield
    torch._dynamo.reset()


def no_compiler(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Any:
    raise RuntimeError("planted: Cannot find a working triton installation")


def test_a_rank_other_than_0_says_its_fallback_naming_itself(data: PhaseData, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "3")  # no process group here: the rank from the environment, as torchrun sets it
    # (an earlier test of the same pytest process may have left a one-rank group up, whose rank 0 would answer)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    config = RunConfig()
    config.model.compile = None  # the default: fall back with a line
    model = no_dropout_model(data.vocab.size)
    plan = attention_plan(config, "phase1", CPU_FP32, DeviceFacts("cpu"), 32)
    assert plan.unpadded and not plan.compile_strict
    prepare_model_path(model, dataclasses.replace(plan, compile=True))  # as CUDA plans it
    layer = compiled_layer(model)
    assert layer is not None and layer.say is say_now and layer.where == f" on rank 3 ({socket.gethostname()})"
    # the same layer, with a backend that cannot compile (inductor would compile here, for tens of seconds)
    planted = CompiledLayer(say=layer.say, backend=no_compiler, where=layer.where.removeprefix(" on "))
    setattr(model, LAYER_FORWARD_ATTRIBUTE, planted)
    torch._dynamo.reset()
    model(**both_layouts(data, [32, 7, 19])[1]).loss.backward()
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"compile: the encoder layer on rank 3 ({socket.gethostname()}) could not be compiled "
                           "(BackendCompilerFailed: "), line
