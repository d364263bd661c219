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
if __name__ == "__main__":
    from pretrain.distributed.lifetime import tie_to_launcher
    from pretrain.distributed.step_watch import dump_stacks_on_signal
    from pretrain.distributed.stop_request import StopRequest

    tie_to_launcher()  # first: a rank still importing when its agent dies dies with it
    dump_stacks_on_signal()  # before the heavy imports: a rank hung in them gives its stacks too
    StopRequest.for_process()  # a stop during them is a stop (main() takes it over); kept until os._exit

import functools
import gc
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from tqdm import tqdm

from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.shard_format.shards import ShardFormatError
from pretrain.checkpointing.checkpoint import (
    CheckpointManager,
    SaveError,
    consolidated_state_dict,
)
from pretrain.checkpointing.commit import ExportError, agree_on_failures, first_line, out_of_space
from pretrain.checkpointing.elastic import prepare_resume
from pretrain.checkpointing.export_tokenizer import TokenizerExportError
from pretrain.checkpointing.manifest import resolve_resume_tag
from pretrain.checkpointing.weights_source import (
    VocabIdentity,
    WeightReader,
    check_checkpoint_vocab,
    initial_weights,
    load_initial_weights,
)
from pretrain.config.cli import parse_args
from pretrain.config.load import load_config
from pretrain.config.sections import RunConfig
from pretrain.data.batches import DataConfigError
from pretrain.device_check.settle import settle_attention
from pretrain.distributed.info import DistInfo, Launch
from pretrain.distributed.lifetime import release_run_folder
from pretrain.distributed.process_group import init_distributed
from pretrain.distributed.step_watch import StepWatch, tell_run_ended
from pretrain.distributed.stop_request import StopRequest
from pretrain.engine import build_engine, rebind_optimizer
from pretrain.errors import NONFINITE_EXIT, SAVE_FAILED_EXIT, USER_ERROR_EXIT, ConfigError, UserError
from pretrain.export import export_checkpoint
from pretrain.metrics.throughput import Throughput
from pretrain.metrics.writer import MetricsWriter
from pretrain.model.bert import build_model
from pretrain.model.compiled import amend_resolved
from pretrain.model.setup import prepare_model_path
from pretrain.plan.run_plan import PhasePlan, RunPlan, plan_on_rank0
from pretrain.plugin import PluginStack, TrainingPlugin, build_plugin
from pretrain.run_folder import EXPORT_INFO, RESOLVED_CONFIG, TENSORBOARD, export_dir
from pretrain.trainer import NonFiniteLossError, PhaseState, PhaseTrainer, TrainerJob

# The ~400k objects these imports made (torch, transformers, DeepSpeed) live as long as the process: frozen, the
# collector skips them, and each phase end's gc.collect() costs ~0.01 s of CPU instead of ~0.2 s (every rank, every
# phase, every process of a scenario that runs several; measured with time.process_time around gc.collect()).
gc.freeze()

__all__ = ["PhaseStart", "build_phase", "main", "run_phase", "train"]


@dataclass
class PhaseStart:
    """Where a phase begins (decided by `_train` from the newest checkpoint): a tag to resume from, or initial
    weights to read (None: fresh weights from the run seed), and the counters the previous phases leave."""

    resume_tag: str | None = None
    init_weights: WeightReader | None = None
    samples_seen: int = 0
    steps_done_in_process: int = 0


def build_phase(plan: PhasePlan, job: TrainerJob, start: PhaseStart) -> PhaseTrainer:
    """The phase's model, weights, engine, data and trainer, from its plan and nothing else (a benchmark or a test
    builds a trainer the same way)."""
    dist_info, plugin = job.dist_info, job.plugin
    torch.manual_seed(plan.run.seed)  # the same initial weights on every rank
    model = build_model(plan.model_config, plan.model.activation_checkpointing)
    if start.init_weights is not None:
        load_initial_weights(model, start.init_weights, f"{plan.name} initial weights", dist_info, plugin.first_rank,
                             plugin.replica_group)
    prepare_model_path(model, plan.attention, ledger=job.compile_ledger)  # refuses what cannot run; compiles
    engine = build_engine(model, plan.ds_config, lr_schedule=plan.schedule, mpu=plugin.mpu)
    job.metrics.mark("engine_built")
    state = PhaseState(phase=plan.name, samples_seen=start.samples_seen)
    if start.resume_tag is not None:
        state = PhaseState.from_dict(job.checkpoints.load(engine, start.resume_tag))
        rebind_optimizer(engine)  # the load re-created ZeRO's partitions
        job.metrics.mark("checkpoint_loaded")
    micro = engine.train_micro_batch_size_per_gpu()
    if dist_info.rank == 0 and plan.attention.note:
        print(plan.attention.note, flush=True)
    train_batches = plan.stream.batches(plan.data, "train", dist_info.rank, dist_info.world_size, micro)
    try:
        val_batches = plan.stream.batches(plan.data, "val", dist_info.rank, dist_info.world_size, micro)
    except (ShardFormatError, DataConfigError) as err:
        val_batches = None  # no held-out shards at this length (or too few for the ranks): no validation numbers
        if dist_info.rank == 0 and plan.trainer.validation.val_every_steps > 0:
            print(f"note: {plan.name}: no validation this phase: {err} (data_prep --val-fraction sets the held-out "
                  "share)", flush=True)
    throughput = Throughput.of(plan.throughput, dist_info.world_size)
    trainer = PhaseTrainer(job, plan.trainer, engine, train_batches, val_batches, throughput, state)
    trainer.steps_this_process = start.steps_done_in_process
    return trainer


def run_phase(plan: PhasePlan, job: TrainerJob, start: PhaseStart) -> tuple[str, PhaseTrainer]:
    """Build the phase from its plan, then train it (the trainer calls the plug-in's `start_phase` first)."""
    trainer = build_phase(plan, job, start)
    progress = None
    if job.dist_info.rank == 0 and plan.trainer.validation.progress_bar:
        progress = tqdm(total=plan.trainer.steps, initial=trainer.state.step, desc=plan.name, unit="step",
                        dynamic_ncols=True)
    try:
        outcome = trainer.train(progress)
    finally:
        if progress is not None:
            progress.close()
    return outcome, trainer


def export_phase(plugin: TrainingPlugin, phase: str, source: Path, out: Path, rank: int,
                 only_missing: bool = False) -> None:
    """The Hugging Face exports of a phase end: the pairs the plug-in names (default: rank 0 exports `source`
    to `out`); `only_missing`: a resumed run redoes an export a crash cut short, and only that.

    Collective. An export that cannot be written (a full disk, a quota) ends the job on every rank: ExportError with
    the exporting rank's words (the driver prints it, exit 4). The phase-end checkpoint is whole, so the same
    command redoes the export alone."""
    failure = None
    for checkpoint, folder in plugin.export_targets(phase, source, out, rank):
        if only_missing and (folder / EXPORT_INFO).is_file():
            continue
        try:
            export_checkpoint(checkpoint, folder)
        except (OSError, SafetensorError) as err:
            fix = "free space" if out_of_space(str(err)) else "remove the cause of that error"
            failure = (f"could not write the export {folder} ({first_line(err)}); the checkpoint in {checkpoint} is "
                       f"whole; {fix}, then rerun the same command (it redoes the export)")
            break
        except TokenizerExportError as err:  # the model is fine; the library around it changed: fix, then rerun
            failure = (f"{err}; the checkpoint in {checkpoint} is whole: rerun the same command once fixed "
                       f"(it redoes the export)")
            break
    failures = agree_on_failures(failure)  # every rank stops together, with the exporting rank's words
    if failures:
        raise ExportError(failures[0])


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
    """Join the job, plan it (the last read of the config), then train the plan."""
    dist_info = init_distributed(config.run.dist_timeout_minutes)
    try:
        configured = build_plugin(config, dist_info)  # collective; the plain run's hooks when no plug-in is on
    except ValueError as err:
        raise ConfigError(str(err)) from err
    plugin = PluginStack(configured, extensions)  # the one plug-in the rest of the run calls
    # The rest runs as a job of the plug-in's share of the world (a codistillation group: its seed, folders, ranks).
    share = plugin.job_share()
    if share is not None:
        dist_info = share.dist_info_for(dist_info)
    plan = settle_attention(plan_on_rank0(config, dist_info, share), dist_info)  # the kernel self-test, agreed
    return train_plan(plan, dist_info, plugin, stop)


@dataclass
class RunProgress:
    """Where the job stands between phases: the newest checkpoint and its trainer state (None: none yet), the
    run's sequences so far and this process's steps (the step budget of run.stop_after_steps counts them)."""

    latest: str | None
    saved: dict[str, Any] | None
    samples_seen: int = 0
    steps_done: int = 0

    def start(self, phase: PhasePlan, checkpoints: CheckpointManager, vocab: VocabIdentity) -> PhaseStart | None:
        """How `phase` starts, or None when the newest checkpoint is already past it."""
        saved, resume_tag, init = self.saved, None, None
        if saved is not None and saved["phase"] == phase.name:
            if saved["complete"]:
                return None
            resume_tag = self.latest
        elif saved is not None and saved["phase"] > phase.name:
            return None
        elif phase.section.init_from:
            init = functools.partial(initial_weights, phase.section.init_from, vocab, f"{phase.name}.init_from")
        elif saved is not None:  # the previous phase's end checkpoint
            init = functools.partial(consolidated_state_dict, checkpoints.root, self.latest)
        return PhaseStart(resume_tag, init, self.samples_seen, self.steps_done)


def record_compile_fallback(job: TrainerJob, why: str) -> None:
    """The layer runs eager for the rest of the run (said once): config.resolved.json and every later checkpoint's
    run config say so. In place: the phase's trainer holds the same dict."""
    job.resolved_config.update(amend_resolved(job.resolved_config, why))
    if job.dist_info.rank == 0:
        atomic_write_json(job.run_dir / RESOLVED_CONFIG, job.resolved_config)


def train_plan(plan: RunPlan, dist_info: DistInfo, plugin: TrainingPlugin, stop: StopRequest) -> str:
    """Run (or resume) the planned phases in order (see `train`)."""
    settings = plan.job
    # the elastic agent's hang timer (off without the agent); each checkpoint file written is progress. The plug-in's
    # state (codistillation's teachers) is saved and loaded with every checkpoint, in its own file.
    watch = StepWatch.from_env()
    checkpoints = CheckpointManager(settings.checkpoint_dir, settings.checkpoint.keep_last, dist_info.rank,
                                    extra_state=plugin, progress=watch.progress)
    # The newest checkpoint, verified against its manifest (a damaged one is set aside for the newest intact one) and
    # trained on the shards' vocab (else refused before anything is written), then, if this job has another number of
    # ranks than the one that wrote it, converted once for them.
    watch.stage("the resume checks")  # timed as start-up (run.startup_timeout_minutes), as is each phase's set-up
    latest = resolve_resume_tag(checkpoints.root, checkpoints.rank)
    if latest is not None:
        check_checkpoint_vocab(checkpoints.root, latest, VocabIdentity.of(plan.resolved["resolved"]),
                               f"resume from {checkpoints.root}")
    if dist_info.rank == 0:
        atomic_write_json(settings.run_dir / RESOLVED_CONFIG, plan.resolved)
    saved = checkpoints.trainer_state(latest) if latest else None
    if latest is not None:
        prepare_resume(checkpoints.root, latest, plan.ds_configs, dist_info.rank, dist_info.world_size,
                       plugin.first_rank, plugin.replica_group)
    first = next(iter(plan.phases.values()))
    if saved is None and first.name == "phase2" and not first.section.init_from:
        raise ConfigError("phase2.init_from: required when phase 2 runs without a phase-1 checkpoint in checkpoint.dir")
    metrics = MetricsWriter(settings.run_dir / TENSORBOARD, enabled=dist_info.rank == 0 and settings.logging.tensorboard,
                            quality=settings.quality)  # and the run's clock, run_clock.json
    metrics.mark("planned")  # start-up so far: imports, joining the job, the plan, the resume checks
    launch = Launch.from_env()
    metrics.launched(launch.run_id, launch.restart)  # the run clock matches the launch's fault records by them
    job = TrainerJob(settings.run_dir, plan.resolved, dist_info, checkpoints, metrics, stop, plugin, watch=watch)
    job.compile_ledger.on_fallback = functools.partial(record_compile_fallback, job)
    progress = RunProgress(latest, saved, saved["samples_seen"] if saved else 0)
    try:
        for phase in plan.phases.values():
            outcome = train_phase(phase, job, progress, settings.checkpoint.export_at_phase_end)
            if outcome != "complete":
                return outcome
        return "complete"
    finally:
        watch.teardown()  # timed from here to the exit (pretrain/distributed/step_watch.py)
        metrics.close()
        release_run_folder(settings.run_dir)


def train_phase(phase: PhasePlan, job: TrainerJob, progress: RunProgress, export_at_end: bool) -> str:
    """One phase of the run: skipped when done (its export redone if a crash cut it short), else trained and
    exported (`export_at_end`); `progress` moves on to its end checkpoint."""
    dist_info, checkpoints = job.dist_info, job.checkpoints
    out = export_dir(job.run_dir, phase.name)
    start = progress.start(phase, checkpoints, VocabIdentity.of(job.resolved_config["resolved"]))
    if start is None:
        if export_at_end and progress.saved is not None and progress.saved["phase"] == phase.name:
            export_phase(job.plugin, phase.name, checkpoints.root / progress.latest, out, dist_info.rank,
                         only_missing=True)  # a crash between the phase-end checkpoint and its export: redo it
        return "complete"
    job.watch.stage(f"{phase.name} set-up")  # model, initial weights, engine (compilation: its first step)
    outcome, trainer = run_phase(phase, job, start)
    progress.steps_done, progress.samples_seen = trainer.steps_this_process, trainer.state.samples_seen
    if outcome != "complete":
        if dist_info.rank == 0:
            then = ("The launcher restarts from it without the evicted host" if job.stop.exit_status
                    else "Rerun the same command to resume")
            print(f"stopped ({outcome}) at {phase.name} step {trainer.state.step}; checkpoint "
                  f"{checkpoints.latest_tag()} written. {then}.", flush=True)
        return outcome
    job.watch.progress()  # the export (rank 0) and the wait for it (the others) get a whole limit
    if export_at_end:
        export_phase(job.plugin, phase.name, checkpoints.root, out, dist_info.rank)
    if dist.is_initialized():
        dist.barrier()
    job.watch.stage(f"{phase.name} teardown")
    progress.saved, progress.latest = trainer.state.state_dict(), checkpoints.latest_tag()
    trainer.engine.destroy()
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return "complete"


def main(argv: list[str] | None = None, extensions: Sequence[TrainingPlugin] = ()) -> int:
    """The driver's command line (module docstring); `extensions`: see train(). Exit 0, 2 (a user error: one
    line), 3 (too many NaN/inf steps in a row), 4 (a checkpoint could not be written: its line is out) or 5 (a slow
    rank's host leaves the job after a checkpoint: run.evict_slow)."""
    # SIGTERM/SIGUSR1 caught from here on: one that comes during start-up (rank 0 hashing shards, a
    # resume's conversion) stops the run at its first step, with a checkpoint, instead of killing it
    # (a SLURM time-limit signal to a job that has just started would otherwise end it un-requeued).
    stop = StopRequest.current()
    config_path, overrides = parse_args(argv)
    try:
        config = load_config(config_path, overrides)
        outcome = train(config, extensions, stop)
    except SaveError as err:  # rank 0's message is the whole line (pretrain/checkpointing/commit.py); under the
        print(err.line(), file=sys.stderr, flush=True)  # elastic agent stderr is the rank's log: the agent shows it
        return SAVE_FAILED_EXIT
    except UserError as err:  # config, data or resume error: one line with its kind's prefix
        print(err.line(), file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return NONFINITE_EXIT
    finally:
        stop.uninstall()
    if stop.exit_status:  # the job leaves a slow rank's host (pretrain/metrics/slow_ranks.py): checkpointed, line out
        return stop.exit_status
    print(f"done: {outcome}", flush=True)
    tell_run_ended(outcome)  # under the elastic agent, in this rank's log: a hang or crash after it is no fault
    return 0


def exit_now(status: int) -> None:
    """End the process with `status`, without the interpreter's teardown. With the process group still up, a C++
    thread torch left joinable is destroyed at exit and aborts the process ("terminate called without an active
    exception", SIGABRT, seen in about one start-up error in four), which turned a config error (2, never
    restarted) into a crash (restarted by the agent); and after a run that ended well the interpreter's garbage
    collection at exit was seen to hang for good (its stacks: "Garbage-collecting", no Python frame). The run's
    files are closed by then (train()'s finally); only the logs and the streams need a flush. A run that ended well
    (every rank alike) tears its process group down first. All of it under the rank's teardown timer: a hang there
    (NCCL's destructors) is named and killed, not a job that never ends."""
    if status == 0 and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
