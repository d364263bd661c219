"""model.attention=auto: the path each device gets, with its facts faked at the one place they are read.

`DeviceFacts` is what `read_device_facts` (pretrain/model/kernel_support.py) returns; every decision (the
precision auto picks, the attention path, the refusal of an explicit unpadded) takes one, so a V100, an H100,
a torch without flash and a CPU are built here, no GPU needed.
"""

from __future__ import annotations

import pytest
import torch

from pretrain.config.attention import attention_plan
from pretrain.config.deepspeed import resolve_precision
from pretrain.config.sections import RunConfig
from pretrain.errors import ConfigError
from pretrain.model.kernel_support import DeviceFacts, read_device_facts

H100 = DeviceFacts("cuda", (9, 0), flash_built=True, bf16=True)
A100 = DeviceFacts("cuda", (8, 0), flash_built=True, bf16=True)
V100 = DeviceFacts("cuda", (7, 0), flash_built=True, bf16=False)
T4 = DeviceFacts("cuda", (7, 5), flash_built=True, bf16=False)
NO_FLASH = DeviceFacts("cuda", (9, 0), flash_built=False, bf16=True)  # a torch build without the flash kernel
CPU = DeviceFacts("cpu")


def plan_for(facts: DeviceFacts, attention: str = "auto", precision: str = "auto", head_dim: int = 64,
             compile: bool | None = None, stage: int = 1):
    """The phase's plan as the run plan makes it: run.precision resolved by the facts, then the path."""
    config = RunConfig()
    config.model.attention, config.model.compile, config.run.precision = attention, compile, precision
    ds = resolve_precision({"zero_optimization": {"stage": stage}}, precision, facts.device_type, facts.bf16)
    return attention_plan(config, "phase1", ds, facts, head_dim)


@pytest.mark.parametrize("facts, precision, head_dim, unpadded, compiled, why", [
    (H100, "auto", 64, True, True, "model.attention=auto: flash varlen on cuda sm90"),
    (A100, "auto", 64, True, True, "flash varlen on cuda sm80"),
    (A100, "fp16", 64, True, True, "flash varlen"),
    (H100, "fp32", 64, False, False, "flash attention runs in bf16 or fp16, this run computes in fp32"),
    (V100, "auto", 64, False, False, "flash attention needs compute capability >= 8.0, this GPU has 7.0"),
    (T4, "auto", 64, False, False, "this GPU has 7.5"),
    (NO_FLASH, "auto", 64, False, False, "this torch build has no flash attention kernel"),
    (H100, "auto", 36, False, False, "a head size that is a multiple of 8 up to 256, this model has 36"),
    (H100, "auto", 512, False, False, "this model has 512"),
    (CPU, "auto", 64, True, False, "the reference varlen kernel on cpu (padded SDPA row for row)"),
    (CPU, "bf16", 36, True, False, "reference varlen kernel"),  # no flash constraint off CUDA
])
def test_auto_takes_the_unpadded_path_where_its_kernel_runs_and_padded_elsewhere(
        facts: DeviceFacts, precision: str, head_dim: int, unpadded: bool, compiled: bool, why: str) -> None:
    plan = plan_for(facts, precision=precision, head_dim=head_dim)
    assert (plan.unpadded, plan.compile, plan.requested, plan.path) == (
        unpadded, compiled, "auto", "unpadded" if unpadded else "padded")
    assert why in plan.why and "\n" not in plan.why
    explicit = plan_for(facts, "padded", precision, head_dim)
    assert (explicit.unpadded, explicit.compile, explicit.why) == (False, False, "model.attention=padded")


@pytest.mark.parametrize("facts, precision, message", [
    (V100, "auto", "^model.attention=unpadded: flash attention needs compute capability >= 8.0, this GPU has 7.0; "
                   "model.attention=padded runs there$"),
    (NO_FLASH, "auto", "^model.attention=unpadded: this torch build has no flash attention kernel; "),
    (H100, "fp32", "^model.attention=unpadded: the flash kernel needs bf16 or fp16 on CUDA, phase1 computes in fp32"),
])
def test_an_explicit_unpadded_where_its_kernel_cannot_run_is_refused_in_one_line(
        facts: DeviceFacts, precision: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_for(facts, "unpadded", precision)
    assert plan_for(H100, "unpadded").unpadded and plan_for(CPU, "unpadded").unpadded


def test_compile_follows_the_resolved_path() -> None:
    """null: compiled where auto runs unpadded on CUDA, not under ZeRO-3, never on CPU; true: strict, and refused
    where auto runs padded (nothing to compile)."""
    assert plan_for(H100, stage=3).compile is False and plan_for(H100, stage=3).unpadded
    assert plan_for(CPU, compile=True).compile_strict and plan_for(CPU, compile=True).compile
    assert not plan_for(H100).compile_strict
    with pytest.raises(ConfigError, match=r"^model.compile=true: compiles the unpadded encoder layers, and "
                                          r"model.attention=auto runs padded SDPA here \(flash attention needs"):
        plan_for(V100, compile=True)
    with pytest.raises(ConfigError, match="^model.compile: compiled layers are not supported with ZeRO-3"):
        plan_for(H100, compile=True, stage=3)


def test_precision_auto_reads_bf16_from_the_same_facts() -> None:
    """The one seam also answers precision auto: bf16 where the GPU has it, else fp16, fp32 on CPU."""
    ds = {"zero_optimization": {"stage": 1}}
    assert resolve_precision(ds, "auto", "cuda", H100.bf16)["bf16"]["enabled"]
    assert resolve_precision(ds, "auto", "cuda", V100.bf16)["fp16"]["enabled"]
    assert read_device_facts(torch.device("cpu")) == CPU


def test_the_seam_reads_torchs_answers_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """read_device_facts on a CUDA device (none here: torch's answers faked): bf16 counts only in hardware, so a
    V100 (which torch says can emulate it) gets fp16 from precision auto."""
    asked = {}

    def bf16(including_emulation: bool = True) -> bool:
        asked["emulation"] = including_emulation
        return including_emulation  # a V100: emulated only

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16)
    assert read_device_facts(torch.device("cuda", 0)) == V100 and asked == {"emulation": False}
