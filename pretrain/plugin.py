"""The hooks an optional training feature plugs into: a one-way dependency.

The core (pretrain/train.py, pretrain/trainer.py) imports only this module and the registry
(pretrain/plugin_registry.py), never a plug-in; a plug-in (pretrain/codistill/) imports the core,
subclasses `TrainingPlugin` and registers a `PluginSpec` under the entry-point group `bert_ds.plugins`,
named after its RUN.json section (pyproject.toml):

    [project.entry-points."bert_ds.plugins"]
    codistill = "pretrain.codistill.spec:SPEC"

The config loader imports a plug-in only when the RUN.json (or an override) has a top-level section
of that name, so a plain run loads no plug-in module at all; `--help` and the docs table list every
installed plug-in's keys. The loader and the driver are handed a `PluginRegistry` (the installed
entry points unless a caller passes another), so they find plug-ins without reaching for the
environment themselves. This module imports nothing of the project at run time but the registry
(types only, from the floors below) and no torch: the contract depends on no core object above it.

A caller of the driver (a test injecting a probe, a NaN loss or a signal) adds its own `TrainingPlugin`
objects, extensions: `pretrain.train.train(config, extensions=[...])`. `PluginStack` puts the run config's
plug-in and those extensions together as the one plug-in the core calls; the hooks that decide the job's
topology or its saved state stay the config plug-in's alone (`CONFIG_PLUGIN_ONLY`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pretrain.plugin_registry import INSTALLED, PluginRegistry

if TYPE_CHECKING:  # types of the floors below this one only (tests/pretrain/test_import_layers.py)
    import torch

    from pretrain.distributed.info import DistInfo

# `config` below is the run config (pretrain/config/sections.py RunConfig), typed loosely: the config composes the
# sections that the loop's components declare, so it sits above the loop that calls these hooks.
RunConfig = Any

# (output, batch, state) -> (extra loss term, numbers to log as the mean over micro-batches and ranks); `output`
# is pretrain.model.bert.PretrainingOutput, `state` the trainer's PhaseState.
ExtraLoss = Callable[[Any, "dict[str, torch.Tensor]", Any], "tuple[torch.Tensor, dict[str, float | torch.Tensor]]"]


@dataclass(frozen=True)
class StepAgreement:
    """What the ranks decide at the end of a step: stop (a signal on some rank), write a checkpoint because
    some rank's clock says `checkpoint.every_minutes` have passed, and whether this model reaches the
    NaN-abort limit (failures.max_consecutive_nonfinite) at this step."""

    stop: bool
    save_due: bool
    aborting_here: bool


@dataclass(frozen=True)
class JobShare:
    """This process's share of the world, as data the core applies (`config_for`, `dist_info_for`): its rank
    and the number of ranks of its job, a seed offset, a subfolder of run.dir and checkpoint.dir, and which
    part of the training data it reads (None: the config's data.part / data.num_parts)."""

    rank: int
    world_size: int
    seed_offset: int = 0
    subfolder: str | None = None
    data_part: tuple[int, int] | None = None  # (part, num_parts)

    def config_for(self, config: RunConfig) -> RunConfig:
        """The run config this job trains with."""
        run, checkpoint, data = config.run, config.checkpoint, config.data
        run = dataclasses.replace(run, seed=run.seed + self.seed_offset)
        if self.subfolder:
            run = dataclasses.replace(run, dir=str(Path(run.dir) / self.subfolder))
            if checkpoint.dir:  # unset, it follows run.dir (<run.dir>/checkpoints)
                checkpoint = dataclasses.replace(checkpoint, dir=str(Path(checkpoint.dir) / self.subfolder))
        if self.data_part is not None:
            data = dataclasses.replace(data, part=self.data_part[0], num_parts=self.data_part[1])
        return dataclasses.replace(config, run=run, checkpoint=checkpoint, data=data)

    def dist_info_for(self, world: DistInfo) -> DistInfo:
        """This process's rank and world size as data sharding, per-rank seeds and batch arithmetic see them."""
        return dataclasses.replace(world, rank=self.rank, world_size=self.world_size)


class PhaseView(Protocol):
    """What `start_phase` and `after_step` may read of the phase being trained (pretrain.trainer.PhaseTrainer
    is one). A hook reads it; the trainer's own work is not changed through it."""

    settings: Any  # the phase's pretrain.phase_state.LoopPlan: phase, steps, the loop's sections, ... (from its plan)
    run_dir: Path  # the job's run folder (a JobShare applied: <run.dir>/<subfolder>)
    state: Any  # the trainer's PhaseState: phase, step (optimizer steps done), samples_seen, ...
    engine: Any  # the DeepSpeed engine; engine.module is the model, engine.module.config its BertConfig
    dist_info: DistInfo  # this process's rank and world size in its job, its device
    metrics: Any  # pretrain.metrics.writer.MetricsWriter: a hook may log scalars at `global_step`

    @property
    def global_step(self) -> int:
        """The TensorBoard x-axis: phase 2 continues after phase 1's steps."""
        ...

    def held_out_batches(self) -> Iterable[dict[str, torch.Tensor]] | None:
        """This rank's micro-batches of one evaluation (the instances the trainer's validation uses, on the
        host); None: no held-out data this phase."""
        ...


class TrainingPlugin:
    """What a plug-in may change in a run. Every default is the plain run's behaviour, so the driver
    calls every hook unconditionally and a plug-in overrides only what it changes. Every hook takes or
    returns data (numbers, paths, tensors, process groups); none hands back a core object.

    The hooks, written once as the loop they sit in (pretrain/train.py drives it, pretrain/trainer.py runs each
    phase; docs/architecture.md says when each is called):

        plugin = PluginSpec.build(config, world)          # once, after the process group exists (collective)
        share = plugin.job_share()                        # the job's config and ranks (None: the whole world)
        plan = plan_on_rank0(config, world, share)        # the job's folders, seed and data part applied
        resume check and conversion:                        plugin.first_rank, plugin.replica_group
        for phase in plan.phases:
            if its end checkpoint exists:                   plugin.export_targets(...)  (only a missing export)
                continue
            initial weights:                                plugin.first_rank, plugin.replica_group
            engine = build_engine(..., mpu=plugin.mpu);     after a checkpoint load: plugin.load_state_dict(state)
            trainer: statistics over plugin.replica_group;  extra = plugin.loss_term()
            plugin.start_phase(view)
            for step in phase:
                for micro_batch in step:  loss = task_loss + extra(output, batch, state)[0]
                agreed, abort_elsewhere = plugin.agree_on_step(step_flags, device)
                log the step;  plugin.after_step(view)
                with every checkpoint:                      plugin.state_dict()  (saved as plugin.state_file)
            phase end: checkpoint, then                     plugin.export_targets(phase, source, out, rank)

    A caller's extensions (PluginStack) take part in `start_phase`, `loss_term` and `after_step` only.
    """

    # Name of the file in each checkpoint tag folder that holds `state_dict()` (None: the plug-in keeps no state).
    # Part of the on-disk format: keep it when the plug-in changes.
    state_file: str | None = None

    # ------------------------------------------------------------------ this job's share of the world
    def job_share(self) -> JobShare | None:
        """This process's share of the world (e.g. a codistillation group's); None: the whole world is one job."""
        return None

    @property
    def mpu(self) -> Any:
        """DeepSpeed's `mpu` (data-parallel group for ZeRO partitions and gradient reduction); None: the world."""
        return None

    @property
    def replica_group(self) -> Any:
        """The process group that holds this model's data-parallel replicas: the trainer averages step and
        validation statistics over it, initial weights are broadcast over it. None: the world."""
        return None

    @property
    def first_rank(self) -> int:
        """Global rank of `replica_group`'s first rank: it reads initial weights and broadcasts them."""
        return 0

    # ------------------------------------------------------------------ state saved with every checkpoint
    def state_dict(self) -> dict[str, Any] | None:
        """What the core's checkpointing saves in `state_file` of every tag (rank 0 of the model, before the
        engine's collective save, so `latest` never names a tag without it). None: nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume: `state_dict()`'s value read back from the tag, after the engine's state is loaded."""

    # ------------------------------------------------------------------ phase start
    def start_phase(self, phase: PhaseView) -> None:
        """Every rank, once per phase: the trainer's first act, after the engine is built and any checkpoint
        loaded (and `load_state_dict` called), before the first step and before the phase's throughput and
        time-due checkpoint clocks start (work done here is not counted as training time)."""

    # ------------------------------------------------------------------ extra loss
    def loss_term(self) -> ExtraLoss | None:
        """A term added to the task loss of every micro-batch (signature: ExtraLoss above; its numbers are
        logged under their own tags). None: the task loss alone."""
        return None

    # ------------------------------------------------------------------ after each optimizer step
    def after_step(self, trainer: PhaseView) -> None:
        """Every rank, after each optimizer step's metrics are logged, before checkpoints and stop checks."""

    # ------------------------------------------------------------------ agreeing on a step's outcome
    def agree_on_step(self, step: StepAgreement, device: torch.device) -> tuple[StepAgreement, str | None]:
        """Every rank, once per step: make a stop, a time-due checkpoint or a NaN abort common to every part
        of the job (a save is a collective: every rank must save after the same step).

        `step.stop` and `step.save_due` are already agreed over `replica_group` (they ride the step's
        statistics all-reduce); `step.aborting_here`: this model reaches failures.max_consecutive_nonfinite
        at this step. Returns what to act on and, when another part of the job aborts at this step while
        this one would not, why (the trainer then checkpoints and raises NonFiniteLossError with it).
        """
        return step, None

    # ------------------------------------------------------------------ export at phase end
    def export_targets(self, phase: str, source: Path, out: Path, rank: int) -> list[tuple[Path, Path]]:
        """At a phase end (all ranks, after the phase-end checkpoint): the (checkpoint folder or tag, Hugging
        Face folder) pairs this process exports; the driver exports them. `rank`: this process's rank in
        its job. Default: the job's rank 0 exports `source` to `out`."""
        return [(source, out)] if rank == 0 else []


def build_plugin(config: RunConfig, dist_info: DistInfo, registry: PluginRegistry = INSTALLED) -> TrainingPlugin:
    """The plug-in this run enables (collective), or the plain run's hooks. ValueError: more than one is on."""
    active = {}
    for name in config.plugins:
        plugin = registry.spec(name).build(config, dist_info)
        if plugin is not None:
            active[name] = plugin
    if len(active) > 1:
        raise ValueError(f"{', '.join(active)}: one training plug-in per run; switch all but one off")
    return next(iter(active.values()), TrainingPlugin())


# The hooks that decide the job's topology or the state saved with it: the run config's plug-in alone answers
# them in a PluginStack; an extension that overrides one is refused.
CONFIG_PLUGIN_ONLY = ("job_share", "mpu", "replica_group", "first_rank", "state_file", "state_dict",
                      "load_state_dict", "agree_on_step", "export_targets")


def overridden_config_hooks(extension: TrainingPlugin) -> list[str]:
    """The CONFIG_PLUGIN_ONLY hooks `extension` changes (its class or the instance sets them)."""
    return [name for name in CONFIG_PLUGIN_ONLY
            if inspect.getattr_static(extension, name) is not inspect.getattr_static(TrainingPlugin, name)]


class PluginStack(TrainingPlugin):
    """The run config's plug-in (`build_plugin`) and a caller's extensions as the one plug-in the core calls.

    `start_phase` and `after_step` run on each in order, the config's plug-in first; `loss_term` sums the
    terms (each micro-batch: the config plug-in's first) and merges their numbers; every CONFIG_PLUGIN_ONLY
    hook is the config plug-in's. ValueError: an extension overrides one of those (naming it); TypeError:
    an extension that is not a TrainingPlugin.
    """

    def __init__(self, configured: TrainingPlugin, extensions: Iterable[TrainingPlugin] = ()) -> None:
        self.configured = configured
        self.extensions = tuple(extensions)
        for extension in self.extensions:
            if not isinstance(extension, TrainingPlugin):
                raise TypeError(f"{extension!r}: an extension must be a pretrain.plugin.TrainingPlugin")
            refused = overridden_config_hooks(extension)
            if refused:
                raise ValueError(f"{type(extension).__name__}: an extension may not override {', '.join(refused)} "
                                 "(the run config's plug-in decides the job's topology and saved state)")
        self.members = (configured, *self.extensions)
        self.state_file = configured.state_file

    # ------------------------------------------------------------------ the config plug-in's alone
    def job_share(self) -> JobShare | None:
        return self.configured.job_share()

    @property
    def mpu(self) -> Any:
        return self.configured.mpu

    @property
    def replica_group(self) -> Any:
        return self.configured.replica_group

    @property
    def first_rank(self) -> int:
        return self.configured.first_rank

    def state_dict(self) -> dict[str, Any] | None:
        return self.configured.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.configured.load_state_dict(state)

    def agree_on_step(self, step: StepAgreement, device: torch.device) -> tuple[StepAgreement, str | None]:
        return self.configured.agree_on_step(step, device)

    def export_targets(self, phase: str, source: Path, out: Path, rank: int) -> list[tuple[Path, Path]]:
        return self.configured.export_targets(phase, source, out, rank)

    # ------------------------------------------------------------------ every member, in order
    def start_phase(self, phase: PhaseView) -> None:
        for member in self.members:
            member.start_phase(phase)

    def after_step(self, trainer: PhaseView) -> None:
        for member in self.members:
            member.after_step(trainer)

    def loss_term(self) -> ExtraLoss | None:
        """The members' terms summed; a single term is returned as it is (a plain run's graph is unchanged)."""
        terms = [term for term in (member.loss_term() for member in self.members) if term is not None]
        if len(terms) <= 1:
            return terms[0] if terms else None

        def summed(output: Any, batch: Any, state: Any) -> tuple[Any, dict[str, Any]]:
            total, numbers = terms[0](output, batch, state)
            for term in terms[1:]:
                more, named = term(output, batch, state)
                total, numbers = total + more, {**numbers, **named}
            return total, numbers

        return summed
