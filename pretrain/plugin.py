"""The hooks an optional training feature plugs into, and how the core finds one: a one-way dependency.

The core (pretrain/config.py, pretrain/train.py, pretrain/trainer.py) imports only this module and
never a plug-in; a plug-in (pretrain/codistill/) imports the core, subclasses `TrainingPlugin` and
registers a `PluginSpec` under the entry-point group `bert_ds.plugins`, named after its RUN.json
section (pyproject.toml):

    [project.entry-points."bert_ds.plugins"]
    codistill = "pretrain.codistill.spec:SPEC"

The config loader imports a plug-in only when the RUN.json (or an override) has a top-level section
of that name, so a plain run loads no plug-in module at all; `--help` and the docs table list every
installed plug-in's keys. No torch import here: reading a config stays instant (the default hooks
import the core pieces they call when they run).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import BertConfig

    from pretrain.checkpointing.checkpoint import CheckpointManager
    from pretrain.config_sections import RunConfig
    from pretrain.engine import DistInfo
    from pretrain.trainer import ExtraLoss, PhaseState, PhaseTrainer

ENTRY_POINT_GROUP = "bert_ds.plugins"


@dataclass(frozen=True)
class StepAgreement:
    """What the ranks decide at the end of a step: stop (a signal on some rank), write a checkpoint because
    some rank's clock says `checkpoint.every_minutes` have passed, and whether this model reaches the
    NaN-abort limit (failures.max_consecutive_nonfinite) at this step."""

    stop: bool
    save_due: bool
    aborting_here: bool


class TrainingPlugin:
    """What a plug-in may change in a run. Every default is the plain run's behaviour, so the driver
    calls every hook unconditionally and a plug-in overrides only what it changes.

    Order in pretrain/train.py: built once per process after the world's process group exists
    (`PluginSpec.build`, collective: every rank builds it at the same point) -> `job_config`,
    `job_dist_info` -> `loss_term`, `after_step` registered -> `checkpoint_manager` -> per phase:
    `first_rank`/`replica_group` (initial weights), `mpu` (engine), `start_phase`, then each step
    `loss_term`'s function per micro-batch, `agree_on_step`, `after_step` -> `export_phase`.
    """

    # ------------------------------------------------------------------ this job's share of the world
    def job_config(self, config: RunConfig) -> RunConfig:
        """The run config this process trains with (e.g. a codistillation group's seed, data part, folders)."""
        return config

    def job_dist_info(self, dist_info: DistInfo) -> DistInfo:
        """This process's rank and world size as data sharding, per-rank seeds and batch arithmetic see them."""
        return dist_info

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

    # ------------------------------------------------------------------ phase start
    def start_phase(self, engine: Any, model_config: BertConfig, state: PhaseState) -> None:
        """Once per phase, after the engine is built and any checkpoint loaded, before the first step."""

    # ------------------------------------------------------------------ extra loss
    def loss_term(self) -> ExtraLoss | None:
        """A term added to the task loss of every micro-batch (signature: pretrain.trainer.ExtraLoss; its
        numbers are logged under their own tags). None: the task loss alone."""
        return None

    # ------------------------------------------------------------------ after each optimizer step
    def after_step(self, trainer: PhaseTrainer) -> None:
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

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_manager(self, root: Path, keep_last: int, rank: int) -> CheckpointManager:
        """Who writes and reads this job's checkpoints (a plug-in may save its own state beside the engine's)."""
        from pretrain.checkpointing.checkpoint import CheckpointManager

        return CheckpointManager(root, keep_last, rank)

    # ------------------------------------------------------------------ export at phase end
    def export_phase(self, phase: str, source: Path, out: Path, rank: int, only_missing: bool = False) -> None:
        """At a phase end (all ranks, after the phase-end checkpoint): the Hugging Face export of `source` (a
        checkpoint folder or tag) to `out`; `only_missing`: a resumed run redoes an export a crash cut short."""
        from pretrain.export import EXPORT_INFO, export_checkpoint

        if rank == 0 and not (only_missing and (out / EXPORT_INFO).is_file()):
            export_checkpoint(source, out)


@dataclass(frozen=True)
class PluginSpec:
    """What a plug-in registers (the entry point's object): light to import, no torch."""

    name: str  # its RUN.json section, equal to its entry-point name
    section: type  # the section's dataclass, keys declared with pretrain.config_doc.setting(default, doc)
    # (section, whole RunConfig) -> None; ValueError naming the dotted key (cross-section checks included)
    check: Callable[[Any, RunConfig], None]
    # (RunConfig, world DistInfo) -> the plug-in, or None when the section turns it off. Collective.
    build: Callable[[RunConfig, DistInfo], TrainingPlugin | None]
    # (section, ranks in the job) -> the data-parallel ranks of one model (what `job_dist_info` will say), without
    # processes: the launch-time batch check (pretrain/preflight.py). None: that check leaves the batch to the ranks.
    data_parallel_size: Callable[[Any, int], int] | None = None


def installed_plugins() -> list[str]:
    """Names of the installed plug-ins (= their RUN.json sections), without importing any of them."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


@functools.cache
def plugin_spec(name: str) -> PluginSpec:
    """Import the plug-in registered as `name` (only then) and return its declaration."""
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise KeyError(f"{name}: no plug-in installed under entry-point group {ENTRY_POINT_GROUP!r}")
    spec = found[0].load()
    if not isinstance(spec, PluginSpec) or spec.name != name:
        raise TypeError(f"entry point {found[0].value!r} must be a PluginSpec named {name!r}, got {spec!r}")
    return spec


def plugin_sections() -> dict[str, type]:
    """Every installed plug-in's section dataclass (imports every plug-in's spec: for --help and docs)."""
    return {name: plugin_spec(name).section for name in installed_plugins()}


def build_plugin(config: RunConfig, dist_info: DistInfo) -> TrainingPlugin:
    """The plug-in this run enables (collective), or the plain run's hooks. ValueError: more than one is on."""
    active = {}
    for name in config.plugins:
        plugin = plugin_spec(name).build(config, dist_info)
        if plugin is not None:
            active[name] = plugin
    if len(active) > 1:
        raise ValueError(f"{', '.join(active)}: one training plug-in per run; switch all but one off")
    return next(iter(active.values()), TrainingPlugin())


def add_losses(first: ExtraLoss | None, second: ExtraLoss | None) -> ExtraLoss | None:
    """One extra-loss hook out of two (a plug-in's and a caller's, e.g. tests injecting NaNs)."""
    if first is None or second is None:
        return first or second

    def combined(output: Any, batch: Any, state: Any) -> tuple[Any, dict[str, Any]]:
        mine, numbers = first(output, batch, state)
        theirs, more = second(output, batch, state)
        return mine + theirs, {**numbers, **more}

    return combined
