"""Whether the configured attention path and compilation can run where the job runs; refused in one line.

`model.attention=unpadded` never falls back to the padded path: where its CUDA kernel cannot run the
run stops at launch, naming what is missing and that `model.attention=padded` runs there. Two layers of
checks, with the same messages:

- `setup_problem` needs no torch (the launch preflight, pretrain/launch/preflight.py, and every rank run it):
  precision and ZeRO stage against the path, from the run config and a phase's DeepSpeed dict;
- the ranks add what needs the device (pretrain/model/varlen_attention.py `kernel_problem`: the torch
  build, the GPU's compute capability, the head size), before the engine is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pretrain.config.deepspeed import precision_of
from pretrain.config.sections import ConfigError, RunConfig

PADDED_HINT = "model.attention=padded runs there"


@dataclass(frozen=True)
class AttentionPlan:
    """A phase's attention path, as the run plan decided it (pretrain/run_plan.py): what the collator lays out,
    what the model runs and whether its layers are compiled. `note`: a line rank 0 says at the phase's start."""

    unpadded: bool
    compile: bool
    note: str | None = None


def attention_plan(config: RunConfig, phase: str, ds_config: dict[str, Any], device_type: str) -> AttentionPlan:
    """Phase `phase`'s attention path on `device_type`; ConfigError: the setup cannot run there (one line)."""
    problem = setup_problem(config, phase, ds_config, device_type)
    if problem is not None:
        raise ConfigError(problem)
    return AttentionPlan(unpadded=config.model.attention == "unpadded",
                         compile=compile_enabled(config, device_type), note=packing_note(config, phase))


def compile_enabled(config: RunConfig, device_type: str) -> bool:
    """model.compile, with null = on CUDA, off elsewhere; never without the unpadded path."""
    if config.model.attention != "unpadded":
        return False
    return bool(config.model.compile) if config.model.compile is not None else device_type == "cuda"


def setup_problem(config: RunConfig, phase: str, ds_config: dict[str, Any], device_type: str) -> str | None:
    """One line saying why this phase's attention / compile setup cannot run (None: it can)."""
    if config.model.attention != "unpadded":
        return None
    if device_type == "cuda" and precision_of(ds_config) == "fp32":
        return (f"model.attention=unpadded: the flash kernel needs bf16 or fp16 on CUDA, {phase} computes in fp32 "
                f"(run.precision); {PADDED_HINT}")
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    if compile_enabled(config, device_type) and stage >= 3:
        return (f"model.compile: compiled layers are not supported with ZeRO-3 ({phase}.ds_config), whose "
                "parameter gathering hooks break the graph; set model.compile=false")
    return None


def packing_note(config: RunConfig, phase: str) -> str | None:
    """What an explicit phaseN.packing means under the unpadded path (said at start, not silently dropped)."""
    if config.model.attention == "unpadded" and config.phase(phase).packing:
        return (f"note: {phase}.packing: the unpadded layout has no rows and no padding to pack; packing applies "
                "to model.attention=padded (the same tokens either way)")
    return None
