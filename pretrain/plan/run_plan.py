"""The run's plan: the one place a RunConfig becomes what the phases run, made before any model or engine exists.

    config ─┬─ the plug-in's JobShare (its seed, folders, data part) ─► the job's config
            └─ every check that needs files (shards, checksums, vocab, each phase's DeepSpeed dict)
                 ─► RunPlan: JobPlan (folders, checkpoints, metrics) + one PhasePlan per phase

A `PhasePlan` carries everything its phase reads: the model config, the DeepSpeed dict, the schedule, the
data, the loop's plan (the config's sections that the loop declares, by reference, and what the plan derived), how the instances become this rank's micro-batches, the inputs of the FLOP
model, and the attention path: chosen by the device's facts (read once, pretrain/model/kernel_support.py), then
confirmed on every host's device before training (pretrain/device_check/settle.py `settle_attention`), so
every rank runs the same path and config.resolved.json records it. The driver (pretrain/train.py) and the trainer read their plan and nothing of
the config, so the config is read here, going one way down; `RunConfig.phase` is called in config/ and here.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import BertConfig

from data_prep.shard_format.atomic_io import atomic_write_json, sha256_file
from data_prep.shard_format.modes import max_predictions_for
from data_prep.shard_format.shards import ShardFormatError
from pretrain.checkpointing.ownership import CheckpointClaim, claim_checkpoint_dir
from pretrain.config.attention import attention_plan
from pretrain.config.deepspeed import phase_ds_config, precision_of
from pretrain.config.sections import (
    CheckpointSection,
    LoggingSection,
    ModelSection,
    PhaseSection,
    RunConfig,
    RunSection,
)
from pretrain.data.batches import DataConfigError, PhaseData, StreamPlan, phase_data
from pretrain.distributed.info import DistInfo, Launch
from pretrain.distributed.json_collectives import broadcast_json
from pretrain.distributed.lifetime import RunFolderBusyError, hold_run_folder
from pretrain.engine import check_ds_config
from pretrain.errors import ConfigError
from pretrain.metrics.monitor_registry import step_monitors
from pretrain.metrics.quality import QualityPlan
from pretrain.metrics.throughput import ThroughputSettings, peak_tflops
from pretrain.model.attention_plan import AttentionPlan
from pretrain.model.bert import OBJECTIVES, bert_config
from pretrain.model.kernel_support import DeviceFacts, read_device_facts
from pretrain.model.presets import flop_parameter_counts
from pretrain.phase_state import LoopPlan
from pretrain.plan.shard_plan import check_run_shards, model_overrides
from pretrain.run_folder import shards_verified_path
from pretrain.schedules.batch import build_batch_ramp
from pretrain.schedules.clock import PhaseClock
from pretrain.schedules.lr import Schedule, build_schedule, schedule_line
from pretrain.schedules.masking import build_mask_schedule
from pretrain.schedules.phase import PhaseSchedules

if TYPE_CHECKING:
    from pretrain.plugin import JobShare


@dataclass(frozen=True)
class PhasePlan:
    """One phase, built once by `plan_run`: everything the phase's model, engine, data and trainer are made of."""

    name: str
    model_config: BertConfig
    ds_config: dict[str, Any]
    precision: str  # bf16 | fp16 | fp32: what ds_config computes in (precision_of)
    schedule: Schedule  # the lr multiplier per optimizer step (SCHEDULES[phaseN.lr_schedule])
    data: PhaseData
    trainer: LoopPlan
    stream: StreamPlan  # how the phase's instances become this rank's micro-batches
    throughput: ThroughputSettings  # the FLOP model's inputs and the device's peak
    attention: AttentionPlan  # the attention path and whether the layers are compiled
    section: PhaseSection  # the config's phaseN: init_from (initial weights; None: the previous phase's end, or fresh)
    run: RunSection  # the config's run: seed (the same initial weights on every rank)
    model: ModelSection  # the config's model: activation_checkpointing


@dataclass(frozen=True)
class JobPlan:
    """What the whole job (all its phases) reads: its folders (derived: checkpoint.dir defaults under run.dir), the
    config's checkpoint section (keep_last, export_at_phase_end) and logging section (tensorboard), the quality
    clock, and the shards' vocab."""

    run_dir: Path
    checkpoint_dir: Path
    checkpoint: CheckpointSection
    logging: LoggingSection
    quality: QualityPlan
    vocab_sha256: str


@dataclass
class RunPlan:
    job: JobPlan
    phases: dict[str, PhasePlan]  # in run.phases order
    resolved: dict[str, Any]  # the run config + what was derived from files (written everywhere)

    @property
    def ds_configs(self) -> dict[str, dict[str, Any]]:
        return {name: phase.ds_config for name, phase in self.phases.items()}


def plan_run(config: RunConfig, dist_info: DistInfo, verify_checksums: bool, facts: DeviceFacts | None = None) -> RunPlan:
    """Every check that needs files, before any model or engine exists. Raises ConfigError/DataConfigError.

    The launch-time check's shard checks (shard_plan.py: the same messages as `./launch.sh`
    gives before any rank starts; each folder's manifest read once), then what only a rank does: hash the
    shards (with `verify_checksums`), build the model config, check each DeepSpeed dict as build_engine will.
    `config` is the job's (a plug-in's share applied: `job_config`); `facts`: the device's (None: read from it).
    """
    shards = check_run_shards(config, verify_checksums and config.data.verify_checksums)
    overrides, max_positions = model_overrides(config, shards[config.run.phases[0]].vocab_size)
    data = {name: phase_data(shards[name], config.phase(name).seq_len) for name in config.run.phases}
    first = data[config.run.phases[0]]
    try:
        # the objective follows the shards (one for the whole run: check_run_shards refuses a mix)
        model_config = bert_config(config.model.preset, first.vocab.size, max_positions,
                                   next_sentence_prediction=first.trains_nsp, **overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    device = dist_info.device
    facts = facts or read_device_facts(device)  # the one read of what the device can run
    phases = {}
    for name in config.run.phases:
        ds = phase_ds_config(config, name, dist_info.world_size, device.type, facts.bf16)
        try:  # what build_engine would refuse, refused now for every phase
            check_ds_config(ds)
        except ValueError as err:
            raise ConfigError(f"{name}.ds_config ({config.phase(name).ds_config}, run.precision={config.run.precision} "
                              f"-> {precision_of(ds)}): {err}") from err
        phases[name] = phase_plan(config, name, model_config, ds, data[name], device, facts)
    run_dir = Path(config.run.dir)
    job = JobPlan(
        run_dir=run_dir, checkpoint_dir=config.checkpoint_dir, checkpoint=config.checkpoint,
        logging=config.logging, quality=QualityPlan(run_dir, dist_info.world_size, config.logging),
        vocab_sha256=first.vocab.sha256,
    )
    resolved = {
        **config.to_dict(),
        "resolved": {
            "model_config": model_config.to_dict(),
            "vocab_file": str(first.manifest.vocab_path.resolve()),
            "vocab_sha256": first.vocab.sha256,
            # the tokenizer that made the shards' ids and its probe (None: shards older than them): the export wraps
            # the one and checks the other (pretrain/checkpointing/export.py)
            "tokenizer_file": _resolved_path(first.manifest.tokenizer_path),
            "tokenizer_probe_file": _resolved_path(first.manifest.probe_path),
            "lowercase": bool(first.manifest.data["vocab"].get("lowercase", True)),
            "ds_configs": {name: phase.ds_config for name, phase in phases.items()},
            "world_size": dist_info.world_size,
            "max_predictions": {name: phase.data.max_predictions for name, phase in phases.items()},
            "mask_probability": {name: d.mask_prob for name, d in data.items()},
            "objective": OBJECTIVES[first.trains_nsp],
            "segments": first.manifest.segments,
            # each phase's lr schedule in words, as the report's and the model card's recipe tables print it
            # (with what else moves over the phase: a masking-rate schedule, a batch warmup)
            "schedules": {name: schedule_line(config.phase(name), config.phase(name).steps)
                          + (phase.stream.schedules.line_tail() if phase.stream.schedules else "")
                          for name, phase in phases.items()},
            # each phase's other schedules in words (the masking rate's; none for static shards)
            "phase_schedules": {name: phase.stream.schedules.describe() for name, phase in phases.items()
                                if phase.stream.schedules is not None},
        },
    }
    return RunPlan(job=job, phases=phases, resolved=resolved)


def phase_plan(config: RunConfig, name: str, model_config: BertConfig, ds: dict[str, Any], data: PhaseData,
               device: torch.device, facts: DeviceFacts) -> PhasePlan:
    """Phase `name` of the job's config, read once: each part of the phase gets its own sections (the config's objects,
    typed as what that part declares) and what is derived here (schedules, attention path, FLOP model, monitors)."""
    phase, precision = config.phase(name), precision_of(ds)
    encoder, head = flop_parameter_counts(model_config.to_dict())
    attention = attention_plan(config, name, ds, facts, head_dim(model_config))  # ConfigError: what cannot run
    schedules = phase_schedules(config, name, data, ds)
    if schedules.masking is not None and phase.max_predictions is None:  # slots for the schedule's highest rate
        highest = max_predictions_for(phase.seq_len, max(schedules.masking.start, schedules.masking.end))
        data = dataclasses.replace(data, max_predictions=max(data.max_predictions, highest))
    return PhasePlan(
        name=name, model_config=model_config, ds_config=ds, precision=precision,
        schedule=build_schedule(phase, phase.steps, f"{name}."), data=data,
        trainer=LoopPlan(  # the sections the loop declares, as this config's objects; the rest derived
            phase=name, section=phase, run=config.run, validation=config.logging, failures=config.failures,
            checkpoint=config.checkpoint, feed=config.data,
            step_offset=config.phase1.steps if name == "phase2" else 0,
            nsp=data.trains_nsp, monitors=step_monitors(phase.seq_len, config.run), schedules=schedules,
        ),
        stream=StreamPlan(run=config.run, parts=config.data, layout=phase, unpadded=attention.unpadded,
                          schedules=schedules),
        throughput=ThroughputSettings(
            encoder_params=encoder, head_params=head, layers=model_config.num_hidden_layers,
            hidden=model_config.hidden_size, seq_len=data.seq_len, predictions=data.max_predictions,
            peak_tflops=peak_tflops(device, precision, config.logging.peak_tflops)),
        attention=attention, section=phase, run=config.run, model=config.model,
    )


def phase_schedules(config: RunConfig, name: str, data: PhaseData, ds: dict[str, Any]) -> PhaseSchedules:
    """Phase `name`'s clock (its batch warmup included) and its schedules besides the lr (pretrain/schedules/): the
    masking rate of dynamic shards from the phase's rate; static shards keep their masks (and refuse a moving rate,
    one ConfigError)."""
    phase = config.phase(name)
    static = data.manifest.static_masking
    masking = build_mask_schedule(phase, data.mask_prob, static, f"{name}.")
    micro_tokens = ds["train_batch_size"] // ds["gradient_accumulation_steps"] * phase.seq_len  # all ranks
    ramp = build_batch_ramp(phase, ds["gradient_accumulation_steps"], f"{name}.", micro_tokens)
    clock = PhaseClock(phase.steps, ds["train_batch_size"], phase.seq_len, ramp)
    return PhaseSchedules(clock, None if static else masking)


def job_config(config: RunConfig, share: JobShare | None) -> RunConfig:
    """The config this job trains with: the run config, with a plug-in's share of the world applied."""
    return config if share is None else share.config_for(config)


def manifest_digests(config: RunConfig) -> dict[str, str]:
    """sha256 of each phase's shard manifest (it lists every shard's sha256: the same digest, the same shards)."""
    return {name: sha256_file(Path(phase.shards or config.data.shards) / "manifest.json")
            for name, phase in config.phases()}


def verified_in_this_launch(config: RunConfig, launch: Launch) -> bool:
    """Whether an earlier start of this same launch (the elastic agent restarting it after a fault) already hashed
    every shard of these manifests: a restart then skips the hashing, which on a real corpus (tens of GB, read
    by rank 0 alone while every rank waits) is the longest part of a recovery's start-up. A new launch (a
    requeue, a rerun) hashes again: files may have changed between jobs."""
    if launch.restart == 0 or not config.data.verify_checksums:
        return False
    try:
        record = json.loads(shards_verified_path(Path(config.run.dir)).read_text(encoding="utf-8"))
        digests = manifest_digests(config)
    except (OSError, ValueError):
        return False
    if record.get("launch") != launch.run_id or record.get("manifests") != digests:
        return False
    print(f"note: restart {launch.restart} of launch {launch.run_id}: the shards were hashed at its start "
          f"({record.get('seconds', 0):.1f} s); not again", flush=True)
    return True


def record_verified(config: RunConfig, launch: Launch, seconds: float) -> None:
    """Rank 0 hashed every shard of this launch's manifests in `seconds` (see verified_in_this_launch)."""
    if launch.run_id is not None and config.data.verify_checksums:
        atomic_write_json(shards_verified_path(Path(config.run.dir)),
                          {"launch": launch.run_id, "manifests": manifest_digests(config), "seconds": round(seconds, 3)})


def plan_on_rank0(config: RunConfig, dist_info: DistInfo, share: JobShare | None = None) -> RunPlan:
    """Rank 0 plans (with checksums) and broadcasts the verdict: all ranks fail together, none hangs; every
    rank plans once, so each shard folder's manifest is read once per rank. `share`: a plug-in's share of the
    world (`dist_info` is then the job's), applied to `config` here.

    Rank 0 also takes the run folder's lock for the job's life: a second job on the same folder (a rerun
    beside ranks that outlived their launcher) stops here instead of writing checkpoints beside them."""
    config = job_config(config, share)
    error: list[Any] = [None]
    plan = None
    if dist_info.rank == 0:
        try:
            launch, started = Launch.from_env(), time.monotonic()
            verify = not verified_in_this_launch(config, launch)
            plan = plan_run(config, dist_info, verify_checksums=verify)
            hold_run_folder(Path(config.run.dir))  # after the checks: a refused run creates no folder
            claim_checkpoint_dir(CheckpointClaim(config.checkpoint_dir, Path(config.run.dir), config.checkpoint.adopt))
            if verify:
                record_verified(config, launch, time.monotonic() - started)
        except (ConfigError, DataConfigError, ShardFormatError, RunFolderBusyError) as err:
            error[0] = str(err)  # as `./launch.sh pretrain`'s launch-time check words it: each names its key
    if dist.is_initialized() and dist_info.world_size > 1:
        error[0] = broadcast_json(error[0], src=0)  # as JSON: a peer's bytes are never unpickled
    if error[0] is not None:
        raise ConfigError(error[0])
    # rank 0 keeps the plan it checked; the others plan once the verdict is in (no hashing: rank 0 did it)
    return plan if plan is not None else plan_run(config, dist_info, verify_checksums=False)


def head_dim(model_config: BertConfig) -> int:
    return model_config.hidden_size // model_config.num_attention_heads


def _resolved_path(path: Path | None) -> str | None:
    return str(path.resolve()) if path is not None else None
