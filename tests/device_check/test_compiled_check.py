"""The compiled layer's self-test (pretrain/device_check/compiled_check.py): the compiled unpadded path passes against the
fp32 padded reference, a backend whose generated code computes wrong numbers fails with them, and a layer that
falls back fails with the fallback's reason. Backends without code generation (inductor costs tens of seconds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pretrain.device_check.compiled_check import compiled_self_test

CPU = torch.device("cpu")


def ten_percent_off(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
    """A stand-in for wrong generated code: the graph's outputs 10 % too large."""
    def run(*args: Any) -> Any:
        return tuple(out * 1.1 for out in gm(*args))

    return run


def no_compiler(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
    raise RuntimeError("planted: Cannot find a working triton installation")


def test_the_compiled_layer_self_test_passes_and_catches_wrong_code_and_a_fallback() -> None:
    torch._dynamo.reset()
    state = torch.random.get_rng_state()
    result = compiled_self_test(CPU, "fp32", 32, 64, backend="eager")
    assert result.passed and result.numbers().startswith(
        "cpu fp32 compiled layer (hidden 64, 2 heads, dropout 0.1/0.1, 6 instances): output error "), result.numbers()
    assert torch.equal(torch.random.get_rng_state(), state)
    wrong = compiled_self_test(CPU, "fp32", 32, 64, backend=ten_percent_off)
    assert not wrong.passed and wrong.logits_error > 10 * wrong.logits_limit, wrong.numbers()
    assert "instances): output error 1.00e-01 is over its limit 1.00e-05; gradients error 1." in wrong.numbers()
    failed = compiled_self_test(CPU, "fp32", 32, 64, backend=no_compiler)
    assert not failed.passed and failed.problem is not None and failed.logits_error < failed.logits_limit  # eager
    assert failed.problem.startswith("the compiled layer fell back: BackendCompilerFailed: backend='no_compiler' "
                                     "raised: RuntimeError: planted"), failed.problem
    assert f"instances): {failed.problem}; output error " in failed.numbers()  # the reason first


def test_the_plan_tests_the_compiled_layer_and_runs_it_eager_when_it_fails(capsys) -> None:
    """settle_attention (pretrain/device_check/settle.py): where a phase compiles, the host tests the compiled layer after the
    kernel; a failure keeps the unpadded path with eager layers under the default, and refuses model.compile=true."""
    import dataclasses

    import pytest

    from pretrain.device_check.settle import DeviceChecks, settle_attention
    from pretrain.errors import ConfigError
    from tests.support.attention_plans import Place, run_plan_stub

    def compiling(plan):  # the stubs plan eager layers; these phases compile them
        phases = {name: dataclasses.replace(p, attention=dataclasses.replace(p.attention, compile=True))
                  for name, p in plan.phases.items()}
        return dataclasses.replace(plan, phases=phases)

    torch._dynamo.reset()
    failed = compiled_self_test(CPU, "fp32", 32, 64, backend=ten_percent_off)  # computed once, given to both plans

    def planted(*_args: Any) -> Any:
        return failed

    settled = settle_attention(compiling(run_plan_stub("auto")), Place(), DeviceChecks(compiled_test=planted))
    assert all(p.attention.unpadded and not p.attention.compile for p in settled.phases.values())
    record = settled.resolved["resolved"]["attention"]["phase2"]
    assert record["path"] == "unpadded" and record["compile"] is False
    assert record["why"].startswith("layers eager: the compiled layer's self-test failed on ")  # the reason first
    assert "compiled layer (" in record["why"] and "; model.attention=" in record["why"]
    with pytest.raises(ConfigError, match=r"^model.compile=true: the compiled layer's self-test failed on "):
        settle_attention(compiling(run_plan_stub("auto", compile_strict=True)), Place(),
                         DeviceChecks(compiled_test=planted))
    capsys.readouterr()
