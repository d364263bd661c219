"""Entry point: phase 1 (seq 128) then phase 2 (seq 512), resumable by rerunning the same command.

    deepspeed pretrain/train.py --config RUN.json [--section.key=value ...]
    python -m pretrain.train --config RUN.json ...            (one process, or under srun / torchrun)

Order of work: read and type-check the config (no processes yet) -> join the process group ->
rank 0 validates everything that needs files (shards, checksums, vocab, batch arithmetic) and
shares the verdict, so every rank fails together with the same message -> for each phase still to
do: build the model, load weights (resume checkpoint, `init_from`, or the previous phase's end),
build the engine, train, checkpoint, export.

An optional feature (codistillation) changes a run only through the TrainingPlugin hooks of
pretrain/plugin.py; this module never imports one, and without a plug-in section the hooks' defaults
are the plain run. A caller (tests) adds its own TrainingPlugin objects the same way: `train(config,
extensions=[...])` / `main(argv, extensions=[...])` (PluginStack: they run after the config's plug-in).

`--help` is answered before torch and DeepSpeed are imported (pretrain/config/cli.py), hence the
imports after that check (E402 off for this file).
"""
# ruff: noqa: E402

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    from pretrain.config.cli import parse_args

    parse_args(sys.argv[1:])  # prints every key with its doc and exits 0, in a fraction of a second

import functools
import gc
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from tqdm import tqdm
from transformers import BertForPreTraining

from data_prep.atomic_io import atomic_write_json
from data_prep.shards import ShardFormatError
from pretrain.checkpointing.checkpoint import (
    CheckpointManager,
    SaveError,
    consolidated_state_dict,
    read_run_config,
    split_checkpoint_path,
)
from pretrain.checkpointing.commit import agree_on_failures, first_line
from pretrain.checkpointing.elastic import prepare_resume
from pretrain.checkpointing.export import export_checkpoint, load_weights
from pretrain.checkpointing.manifest import resolve_resume_tag
from pretrain.config.attention import packing_note
from pretrain.config.cli import parse_args
from pretrain.config.deepspeed import precision_of
from pretrain.config.load import load_config
from pretrain.config.sections import ConfigError, RunConfig
from pretrain.data.batches import DataConfigError, RankBatches
from pretrain.dist import DistInfo
from pretrain.engine import build_engine, client_optimizer, init_distributed
from pretrain.errors import UserError
from pretrain.launch.lifetime import release_run_folder
from pretrain.metrics import MetricsWriter, Throughput, flops_per_sequence, peak_tflops
from pretrain.model.bert import build_model, count_parameters
from pretrain.model_setup import prepare_model_path
from pretrain.optim.lamb import ExactLamb, bind_zero_layout
from pretrain.plugin import PluginStack, TrainingPlugin, build_plugin
from pretrain.report.quality import QualitySettings
from pretrain.run_folder import EXPORT_INFO, RESOLVED_CONFIG, TENSORBOARD, export_dir
from pretrain.run_plan import PhasePlan, RunPlan, bert_config_from_plan, plan_on_rank0, plan_run
from pretrain.step_watch import StepWatch
from pretrain.stop_request import StopRequest
from pretrain.trainer import NonFiniteLossError, PhaseState, PhaseTrainer, TrainerJob

__all__ = ["PhasePlan", "PhaseStart", "RunPlan", "bert_config_from_plan", "main", "plan_run", "run_phase", "train"]
WeightReader = Callable[[], dict[str, torch.Tensor]]  # reads a phase's initial fp32 weights from disk


@dataclass
class PhaseStart:
    """Where a phase begins (decided by `_train` from the newest checkpoint): a tag to resume from, or initial
    weights to read (None: fresh weights from the run seed), and the counters the previous phases leave."""

    resume_tag: str | None = None
    init_weights: WeightReader | None = None
    samples_seen: int = 0
    steps_done_in_process: int = 0


def initial_weights(path: str, expected_vocab_sha: str, key: str) -> dict[str, torch.Tensor]:
    """fp32 weights from a checkpoint (folder or tag) or a Hugging Face export of this toolkit."""
    folder = Path(path)
    if (folder / "config.json").is_file():
        info = folder / EXPORT_INFO
        if info.is_file():
            sha = json.loads(info.read_text(encoding="utf-8")).get("vocab_sha256")
            if sha and sha != expected_vocab_sha:
                raise ConfigError(f"{key}: {path} was trained with another vocab (sha256 {sha[:12]})")
        return BertForPreTraining.from_pretrained(str(folder), local_files_only=True).state_dict()
    try:
        root, tag = split_checkpoint_path(folder)
    except FileNotFoundError as err:
        raise ConfigError(f"{key}: {err}") from err
    sha = read_run_config(root, tag)["resolved"]["vocab_sha256"]
    if sha != expected_vocab_sha:
        raise ConfigError(f"{key}: {root / tag} was trained with another vocab (sha256 {sha[:12]})")
    return consolidated_state_dict(root, tag)


def run_phase(plan: PhasePlan, job: TrainerJob, start: PhaseStart) -> tuple[str, PhaseTrainer]:
    """Build the phase's model, weights, engine, data and trainer from its plan, then train it (the trainer
    calls the plug-in's `start_phase` first)."""
    name, config, dist_info, plugin = plan.name, job.config, job.dist_info, job.plugin
    phase = config.phase(name)
    torch.manual_seed(config.run.seed)  # the same initial weights on every rank
    model_config = plan.model_config
    model = build_model(model_config, config.model.activation_checkpointing)
    if start.init_weights is not None:
        load_initial_weights(model, start.init_weights, f"{name} initial weights", dist_info, plugin.first_rank,
                             plugin.replica_group)
    ds = plan.ds_config
    prepare_model_path(model, config, name, ds, dist_info.device)  # refuses what cannot run; compiles
    counts = count_parameters(model)
    engine = build_engine(model, ds, lr_schedule=plan.schedule, mpu=plugin.mpu)
    state = PhaseState(phase=name, samples_seen=start.samples_seen)
    if start.resume_tag is not None:
        state = PhaseState.from_dict(job.checkpoints.load(engine, start.resume_tag))
        if isinstance(client_optimizer(engine), ExactLamb):
            bind_zero_layout(engine)
    micro = engine.train_micro_batch_size_per_gpu()
    data = plan.data
    unpadded = config.model.attention == "unpadded"
    if dist_info.rank == 0 and packing_note(config, name):
        print(packing_note(config, name), flush=True)
    train_batches = RankBatches(data, "train", config.run.seed, dist_info.rank, dist_info.world_size, micro,
                                packing=phase.packing, part=config.data.part, num_parts=config.data.num_parts,
                                unpadded=unpadded)
    try:
        val_batches = RankBatches(data, "val", config.run.seed, dist_info.rank, dist_info.world_size, micro,
                                  shuffle=False, unpadded=unpadded)
    except (ShardFormatError, DataConfigError) as err:
        val_batches = None  # no held-out shards at this length (or too few for the ranks): no validation numbers
        if dist_info.rank == 0 and config.logging.val_every_steps > 0:
            print(f"note: {name}: no validation this phase: {err} (data_prep --val-fraction sets the held-out "
                  "share)", flush=True)
    precision = precision_of(ds)
    flops = flops_per_sequence(
        counts["encoder"], counts["mlm_head"], model_config.num_hidden_layers, model_config.hidden_size,
        phase.seq_len, data.max_predictions,
    )
    throughput = Throughput(flops, phase.seq_len, dist_info.world_size,
                            peak_tflops(dist_info.device, precision, config.logging.peak_tflops),
                            head_flops_per_prediction=6.0 * counts["mlm_head"], predictions_per_seq=data.max_predictions)
    trainer = PhaseTrainer(job, engine, train_batches, val_batches, throughput, state)
    trainer.steps_this_process = start.steps_done_in_process
    progress = None
    if dist_info.rank == 0 and config.logging.progress_bar:
        progress = tqdm(total=phase.steps, initial=state.step, desc=name, unit="step", dynamic_ncols=True)
    try:
        outcome = trainer.train(progress)
    finally:
        if progress is not None:
            progress.close()
    return outcome, trainer


def load_initial_weights(
    model: torch.nn.Module, read: WeightReader, source: str, dist_info: DistInfo, src: int, group: Any
) -> None:
    """The model's first rank reads (and consolidates) the weights once; the other ranks receive them.

    Every rank reading a phase-1 checkpoint itself would make N ranks each read every rank's partition
    (an I/O storm of N x checkpoint size on a shared file system at 256 ranks). A read error is
    shared first, so all ranks fail together with the same message. `src` is the global rank of this
    model's first rank, `group` its process group (None: the world).
    """
    error: list[str | None] = [None]
    if dist_info.rank == 0:
        try:
            load_weights(model, read(), source)
        except (ConfigError, FileNotFoundError, ValueError) as err:
            error[0] = str(err)
    if dist_info.world_size > 1 and dist.is_initialized():
        dist.broadcast_object_list(error, src=src, group=group)
    if error[0] is not None:
        raise ConfigError(error[0])
    if dist_info.world_size > 1 and dist.is_initialized():
        model.to(dist_info.device)  # NCCL broadcasts device tensors; the engine would move it there anyway
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=src, group=group)


def export_phase(plugin: TrainingPlugin, phase: str, source: Path, out: Path, rank: int,
                 only_missing: bool = False) -> None:
    """The Hugging Face exports of a phase end: the pairs the plug-in names (default: rank 0 exports `source`
    to `out`); `only_missing`: a resumed run redoes an export a crash cut short, and only that.

    Collective. An export that cannot be written (a full disk, a quota) ends the job on every rank: one line
    from the rank that exported, then SaveError (exit 4). The phase-end checkpoint is whole, so the same
    command redoes the export alone."""
    failure = None
    for checkpoint, folder in plugin.export_targets(phase, source, out, rank):
        if only_missing and (folder / EXPORT_INFO).is_file():
            continue
        try:
            export_checkpoint(checkpoint, folder)
        except (OSError, SafetensorError) as err:
            failure = (f"could not write the export {folder} ({first_line(err)}); the checkpoint in {checkpoint} is "
                       "whole; free space, then rerun the same command (it redoes the export)")
            print(f"export error: {failure}", flush=True)
            break
    failures = agree_on_failures(failure)  # every rank stops together, after the line is out
    if failures:
        raise SaveError(failures[0])


def train(config: RunConfig, extensions: Sequence[TrainingPlugin] = (), stop: StopRequest | None = None) -> str:
    """Run (or resume) the configured phases. Returns 'complete' or why it stopped early.

    `extensions`: TrainingPlugin objects a caller adds (tests: probes, NaN losses, signals); their
    `start_phase`, `loss_term` and `after_step` run after the config plug-in's, on every rank (PluginStack;
    ValueError: one overrides a hook that only the config's plug-in may answer). `stop`: a StopRequest the
    caller installed earlier (main() does, before start-up work), else one is installed here.
    """
    own_stop = stop is None
    stop = stop or StopRequest()
    if own_stop:
        stop.install()
    try:
        return _train(config, extensions, stop)
    finally:
        if own_stop:
            stop.uninstall()


def _train(config: RunConfig, extensions: Sequence[TrainingPlugin], stop: StopRequest) -> str:
    dist_info = init_distributed(config.run.dist_timeout_minutes)
    try:
        configured = build_plugin(config, dist_info)  # collective; the plain run's hooks when no plug-in is on
    except ValueError as err:
        raise ConfigError(str(err)) from err
    plugin = PluginStack(configured, extensions)  # the one plug-in the rest of the run calls
    # The rest runs as a job of the plug-in's share of the world (a codistillation group: its seed, folders, ranks).
    share = plugin.job_share()
    if share is not None:
        config, dist_info = share.config_for(config), share.dist_info_for(dist_info)
    plan = plan_on_rank0(config, dist_info)
    run_dir = Path(config.run.dir)
    # the plug-in's state (codistillation's teachers) saved and loaded with every checkpoint, in its own file
    # the elastic agent's hang timer (off without the agent); each checkpoint file written is progress
    watch = StepWatch.from_env()
    checkpoints = CheckpointManager(config.checkpoint_dir, config.checkpoint.keep_last, dist_info.rank,
                                    extra_state=plugin, progress=watch.progress)
    if dist_info.rank == 0:
        atomic_write_json(run_dir / RESOLVED_CONFIG, plan.resolved)
    # The newest checkpoint, verified against its manifest (a damaged one is set aside for the newest intact one),
    # then, if this job has another number of ranks than the one that wrote it, converted once for them.
    latest = resolve_resume_tag(checkpoints.root, checkpoints.rank)
    saved = checkpoints.trainer_state(latest) if latest else None
    if latest is not None:
        prepare_resume(checkpoints.root, latest, plan.ds_configs, dist_info.rank, dist_info.world_size,
                       plugin.first_rank, plugin.replica_group)
    if saved is None and config.run.phases[0] == "phase2" and not config.phase2.init_from:
        raise ConfigError("phase2.init_from: required when phase 2 runs without a phase-1 checkpoint in checkpoint.dir")
    quality = QualitySettings(run_dir, tuple(config.logging.quality_targets), dist_info.world_size)  # run_clock.json
    metrics = MetricsWriter(run_dir / TENSORBOARD, enabled=dist_info.rank == 0 and config.logging.tensorboard,
                            quality=quality)
    job = TrainerJob(config, plan.resolved, dist_info, checkpoints, metrics, stop, plugin, watch=watch)
    samples_seen = saved["samples_seen"] if saved else 0
    steps_done = 0
    try:
        for name in config.run.phases:
            resume_tag, init = None, None
            if saved is not None and saved["phase"] == name:
                if saved["complete"]:
                    if config.checkpoint.export_at_phase_end:  # a crash between checkpoint and export: redo it
                        export_phase(plugin, name, checkpoints.root / latest, export_dir(run_dir, name),
                                     dist_info.rank, only_missing=True)
                    continue
                resume_tag = latest
            elif saved is not None and saved["phase"] > name:
                continue  # this run is already past this phase
            elif config.phase(name).init_from:
                init = functools.partial(initial_weights, config.phase(name).init_from,
                                         plan.resolved["resolved"]["vocab_sha256"], f"{name}.init_from")
            elif saved is not None:  # the previous phase's end checkpoint
                init = functools.partial(consolidated_state_dict, checkpoints.root, latest)
            outcome, trainer = run_phase(plan.phases[name], job, PhaseStart(resume_tag, init, samples_seen, steps_done))
            steps_done = trainer.steps_this_process
            samples_seen = trainer.state.samples_seen
            if outcome != "complete":
                if dist_info.rank == 0:
                    print(f"stopped ({outcome}) at {name} step {trainer.state.step}; checkpoint "
                          f"{checkpoints.latest_tag()} written. Rerun the same command to resume.", flush=True)
                return outcome
            watch.progress()  # the export (rank 0) and the wait for it (the others) get a whole limit
            if config.checkpoint.export_at_phase_end:
                export_phase(plugin, name, checkpoints.root, export_dir(run_dir, name), dist_info.rank)
            if dist.is_initialized():
                dist.barrier()
            watch.end()  # the next phase's engine is built untimed
            saved, latest = trainer.state.state_dict(), checkpoints.latest_tag()
            trainer.engine.destroy()
            del trainer
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return "complete"
    finally:
        metrics.close()
        release_run_folder(run_dir)


def main(argv: list[str] | None = None, extensions: Sequence[TrainingPlugin] = ()) -> int:
    """The driver's command line (module docstring); `extensions`: see train(). Exit 0, 2 (a user error: one
    line), 3 (too many NaN/inf steps in a row) or 4 (a checkpoint could not be written: its line is out)."""
    # SIGTERM/SIGUSR1 caught from here on: one that comes during start-up (rank 0 hashing shards, a
    # resume's conversion) stops the run at its first step, with a checkpoint, instead of killing it
    # (a SLURM time-limit signal to a job that has just started would otherwise end it un-requeued).
    stop = StopRequest()
    stop.install()
    config_path, overrides = parse_args(argv)
    try:
        config = load_config(config_path, overrides)
        outcome = train(config, extensions, stop)
    except SaveError:  # rank 0 printed its one line where the save failed (pretrain/checkpointing/commit.py)
        return 4
    except UserError as err:  # config, data or resume error: one line with its kind's prefix
        print(err.line(), file=sys.stderr, flush=True)
        return 2
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 3
    finally:
        stop.uninstall()
    print(f"done: {outcome}", flush=True)
    return 0


def exit_now(status: int) -> None:
    """End the process with `status`. A failed run ends without the interpreter's teardown: with the process
    group still up, a C++ thread torch left joinable is destroyed at exit and aborts the process ("terminate
    called without an active exception", SIGABRT, seen in about one start-up error in four), which turned a
    config error (2, never restarted) into a crash (restarted by the agent). The run's files are closed by
    then (train()'s finally); only the streams need a flush."""
    if status == 0:
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
