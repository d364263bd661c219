"""A run's disk needs from its config: the largest phase's checkpoint times the checkpoints held at once, every
phase's export, and the folders they land in (the sizes and the free-space check on plain values:
pretrain/checkpointing/footprint.py, whose docstring says what a checkpoint holds and what a run keeps).

It reads the run config's phases and checkpoint settings, so it sits on the plan's floor: the launch-time check
(pretrain/launch/preflight.py) and the recipe scaler (pretrain/launch/scale.py) call it before any rank starts.
Standard library only, like the module it sums: the launch-time check runs it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpointing.footprint import (
    CheckpointShape,
    Destination,
    RunFootprint,
    checkpoint_bytes,
    export_bytes,
    human,
    parameter_tensors,
)
from pretrain.config.deepspeed import precision_of
from pretrain.config.sections import RunConfig
from pretrain.model.presets import bert_parameter_count
from pretrain.run_folder import EXPORT


@dataclass(frozen=True)
class JobSizing:
    """What sizes a run's files, as the launch-time check knows it before any rank starts."""

    model_fields: dict[str, int]  # the BertConfig fields of model.preset + model.overrides, vocab from the shards
    vocab_file_bytes: int
    ds_configs: dict[str, dict[str, Any]]  # each phase's resolved DeepSpeed dict (precision, ZeRO stage)
    dp_size: int  # ranks of one model
    models: int  # models of the job (world size / dp_size: codistillation groups)


def run_footprint(config: RunConfig, sizing: JobSizing) -> RunFootprint:
    """The run's checkpoints and exports at their fullest (checkpointing/footprint.py's docstring), sized by the
    largest phase's checkpoint."""
    parameters = bert_parameter_count(sizing.model_fields)
    sizes = []
    for name in config.run.phases:
        ds = sizing.ds_configs[name]
        precision = precision_of(ds)
        stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        sizes.append(checkpoint_bytes(CheckpointShape(parameters, parameter_tensors(sizing.model_fields), precision,
                                                      stage, sizing.dp_size, sizing.models)))
    phases = len(config.run.phases)
    exports = phases if config.checkpoint.export_at_phase_end else 0
    return RunFootprint(max(sizes), export_bytes(parameters, sizing.vocab_file_bytes, sizing.models),
                        config.checkpoint.keep_last + 1 + (phases - 1), exports)


def run_destinations(config: RunConfig, footprint: RunFootprint) -> list[Destination]:
    """Where the footprint lands: the checkpoints in checkpoint.dir (default <run.dir>/checkpoints), the exports
    in <run.dir>/export (pretrain/run_folder.py); check_free_space adds them up when they share a file system."""
    run_dir = Path(config.run.dir)
    key, named = ("checkpoint.dir", config.checkpoint_dir) if config.checkpoint.dir else ("run.dir", run_dir)
    checkpoints = Destination(key, named, config.checkpoint_dir,
                              footprint.checkpoint_total, f"{footprint.checkpoints_at_peak} checkpoints x "
                              f"{human(footprint.checkpoint)}: checkpoint.keep_last {config.checkpoint.keep_last} "
                              f"+ 1 being written{' + earlier phase ends' * (len(config.run.phases) > 1)}")
    found = [checkpoints]
    if footprint.exports:
        found.append(Destination("run.dir", run_dir, run_dir / EXPORT, footprint.export_total,
                                 f"{footprint.exports} export{'s' * (footprint.exports > 1)} x "
                                 f"{human(footprint.export)}"))
    return found
