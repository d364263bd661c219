"""The attention path a phase runs, chosen by what the device can run; what cannot run is refused in one line.

`model.attention`:
- `auto` (the default): the unpadded path where its kernel runs (pretrain/model/kernel_support.py: on CUDA the
  flash varlen kernel, bf16/fp16 on sm80+ with a torch build that has it; elsewhere the reference kernel, equal
  to padded row for row), padded SDPA otherwise. The kernel self-test then confirms the choice on the device
  before training (pretrain/device_check/settle.py `settle_attention`); a failed test makes it padded on every rank.
- `unpadded`: the same path, refused in one line where it cannot run (and where its self-test fails);
- `padded`: transformers' SDPA on rows of seq_len, the reference.

Two layers of checks, with the same messages:
- `setup_problem` needs no torch and no device (the launch preflight, pretrain/launch/preflight.py): an explicit
  unpadded computing in fp32 on CUDA, an explicit model.compile=true with ZeRO-3;
- `attention_plan` (every rank, in the run plan) adds the device's facts, read once by the caller.
"""

from __future__ import annotations

from typing import Any

from pretrain.config.deepspeed import precision_of
from pretrain.config.sections import RunConfig
from pretrain.errors import ConfigError
from pretrain.model.attention_plan import AttentionPlan
from pretrain.model.kernel_support import DeviceFacts, unpadded_kernel, unpadded_problem

PADDED_HINT = "model.attention=padded runs there"


def zero_stage(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def attention_plan(config: RunConfig, phase: str, ds_config: dict[str, Any], facts: DeviceFacts,
                   head_dim: int) -> AttentionPlan:
    """Phase `phase`'s attention path on a device with `facts`; ConfigError: the setup cannot run there (one line)."""
    problem = setup_problem(config, phase, ds_config, facts.device_type)
    if problem is not None:
        raise ConfigError(problem)
    requested = config.model.attention
    kernel_problem = unpadded_problem(facts, precision_of(ds_config), head_dim)
    if requested == "unpadded" and kernel_problem is not None:
        raise ConfigError(f"model.attention=unpadded: {kernel_problem}; {PADDED_HINT}")
    unpadded = requested == "unpadded" or (requested == "auto" and kernel_problem is None)
    if config.model.compile and not unpadded:
        raise ConfigError(f"model.compile=true: compiles the unpadded encoder layers, and model.attention=auto runs "
                          f"padded SDPA here ({kernel_problem}); set model.compile=false or null")
    why = (f"model.attention={requested}" if requested == "padded" else
           f"model.attention={requested}: {unpadded_kernel(facts) if unpadded else kernel_problem}")
    return AttentionPlan(unpadded=unpadded, compile=compile_enabled(config, facts.device_type, ds_config, unpadded),
                         note=packing_note(config, phase, unpadded), requested=requested, why=why,
                         compile_strict=config.model.compile is True)


def compile_enabled(config: RunConfig, device_type: str, ds_config: dict[str, Any], unpadded: bool) -> bool:
    """model.compile on the unpadded path (never without it): null = on with CUDA, except under ZeRO-3 (whose
    parameter gathering hooks break the graph), off elsewhere."""
    if not unpadded:
        return False
    if config.model.compile is None:
        return device_type == "cuda" and zero_stage(ds_config) < 3
    return bool(config.model.compile)


def setup_problem(config: RunConfig, phase: str, ds_config: dict[str, Any], device_type: str) -> str | None:
    """One line saying why this phase's attention / compile setup cannot run (None: it can), from the config alone."""
    if config.model.attention == "unpadded" and device_type == "cuda" and precision_of(ds_config) == "fp32":
        return (f"model.attention=unpadded: the flash kernel needs bf16 or fp16 on CUDA, {phase} computes in fp32 "
                f"(run.precision); {PADDED_HINT}")
    if config.model.compile and zero_stage(ds_config) >= 3:
        return (f"model.compile: compiled layers are not supported with ZeRO-3 ({phase}.ds_config), whose "
                "parameter gathering hooks break the graph; set model.compile=false or null")
    return None


def packing_note(config: RunConfig, phase: str, unpadded: bool) -> str | None:
    """What an explicit phaseN.packing means under the unpadded path (said at start, not silently dropped)."""
    if unpadded and config.phase(phase).packing:
        return (f"note: {phase}.packing: the unpadded layout has no rows and no padding to pack; packing applies "
                "to model.attention=padded (the same tokens either way)")
    return None
