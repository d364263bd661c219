"""The run's plan, made before any model or engine exists: every check that needs files, then one
`PhasePlan` per phase (model config, DeepSpeed dict, schedule, data), built once and handed to
`pretrain.train.run_phase`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import BertConfig

from data_prep.shards import ShardFormatError
from pretrain.config.deepspeed import phase_ds_config, precision_of
from pretrain.config.sections import ConfigError, RunConfig
from pretrain.data.batches import DataConfigError, PhaseData, phase_data
from pretrain.data.shard_checks import check_run_shards, model_overrides
from pretrain.dist import DistInfo
from pretrain.engine import check_ds_config
from pretrain.launch.lifetime import RunFolderBusyError, hold_run_folder
from pretrain.model.bert import bert_config
from pretrain.schedule import WarmupPolyDecay


@dataclass
class PhasePlan:
    """One phase, built once by `plan_run`: what its model, engine and data are made of."""

    name: str
    model_config: BertConfig
    ds_config: dict[str, Any]
    schedule: WarmupPolyDecay
    data: PhaseData


@dataclass
class RunPlan:
    data: dict[str, PhaseData]
    ds_configs: dict[str, dict[str, Any]]
    resolved: dict[str, Any]  # the run config + what was derived from files (written everywhere)
    model_config: BertConfig
    phases: dict[str, PhasePlan]


def plan_run(config: RunConfig, dist_info: DistInfo, verify_checksums: bool) -> RunPlan:
    """Every check that needs files, before any model or engine exists. Raises ConfigError/DataConfigError.

    The launch-time check's shard checks (pretrain/data/shard_checks.py: the same messages as `./launch.sh`
    gives before any rank starts; each folder's manifest read once), then what only a rank does: hash the
    shards (with `verify_checksums`), build the model config, check each DeepSpeed dict as build_engine will.
    """
    shards = check_run_shards(config, verify_checksums and config.data.verify_checksums)
    overrides, max_positions = model_overrides(config, shards[config.run.phases[0]].vocab_size)
    data = {name: phase_data(shards[name], config.phase(name).seq_len) for name in config.run.phases}
    first = data[config.run.phases[0]]
    try:
        model_config = bert_config(config.model.preset, first.vocab.size, max_positions, **overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    device = dist_info.device
    bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
    ds_configs = {
        name: phase_ds_config(config, name, dist_info.world_size, device.type, bf16_ok) for name in config.run.phases
    }
    for name, ds in ds_configs.items():  # what build_engine would refuse, refused now for every phase
        try:
            check_ds_config(ds)
        except ValueError as err:
            raise ConfigError(f"{name}.ds_config ({config.phase(name).ds_config}, run.precision={config.run.precision} "
                              f"-> {precision_of(ds)}): {err}") from err
    resolved = {
        **config.to_dict(),
        "resolved": {
            "model_config": model_config.to_dict(),
            "vocab_file": str(first.manifest.vocab_path.resolve()),
            "vocab_sha256": first.vocab.sha256,
            "lowercase": bool(first.manifest.data["vocab"].get("lowercase", True)),
            "ds_configs": ds_configs,
            "world_size": dist_info.world_size,
            "max_predictions": {name: d.max_predictions for name, d in data.items()},
        },
    }
    phases = {
        name: PhasePlan(name, model_config, ds_configs[name], WarmupPolyDecay(
            config.phase(name).steps, config.phase(name).warmup_fraction, config.phase(name).decay_power),
            data[name])
        for name in config.run.phases
    }
    return RunPlan(data=data, ds_configs=ds_configs, resolved=resolved, model_config=model_config, phases=phases)


def plan_on_rank0(config: RunConfig, dist_info: DistInfo) -> RunPlan:
    """Rank 0 plans (with checksums) and broadcasts the verdict: all ranks fail together, none hangs; every
    rank plans once, so each shard folder's manifest is read once per rank.

    Rank 0 also takes the run folder's lock for the job's life: a second job on the same folder (a rerun
    beside ranks that outlived their launcher) stops here instead of writing checkpoints beside them."""
    error: list[Any] = [None]
    plan = None
    if dist_info.rank == 0:
        try:
            plan = plan_run(config, dist_info, verify_checksums=True)
            hold_run_folder(Path(config.run.dir))  # after the checks: a refused run creates no folder
        except (ConfigError, DataConfigError, ShardFormatError, RunFolderBusyError) as err:
            error[0] = str(err)  # as `./launch.sh pretrain`'s launch-time check words it: each names its key
    if dist.is_initialized() and dist_info.world_size > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ConfigError(error[0])
    # rank 0 keeps the plan it checked; the others plan once the verdict is in (no hashing: rank 0 did it)
    return plan if plan is not None else plan_run(config, dist_info, verify_checksums=False)


def bert_config_from_plan(plan: RunPlan) -> BertConfig:
    """The model config `plan_run` built (kept for callers that build a trainer themselves)."""
    return plan.model_config
