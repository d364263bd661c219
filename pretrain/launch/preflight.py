"""The launch-time check of a pretraining run: everything that needs no GPU, once, in one light process.

Without it a typo'd key, a wrong `data.shards` or a DeepSpeed JSON that sets a recipe's key was
reported only after the launcher had started every rank and each had imported torch and DeepSpeed
(about 2 minutes on 2 cores; on a cluster, after the job got its nodes), under a screen of DeepSpeed
INFO lines. `./launch.sh pretrain` now runs this first, for every launcher (this machine, a hostfile,
a SLURM allocation: pretrain/launch/plan.py `launch --check-run`), and a problem is one line and
exit status 2 before any rank or node is touched:

- the run config and its overrides: every key and value (pretrain/config/load.py; a near miss gets a
  "did you mean"), the plug-ins' own checks;
- each phase's DeepSpeed JSON: readable, no key the run config owns (pretrain/config/deepspeed.py), lr, and
  the batch arithmetic for the world size the launch will have, and with `--nodes MIN:MAX` for every node count a
  restart may have: a phase whose global batch would change (or not divide) on fewer nodes is refused, naming the
  node counts and the setting that fixes it (`check_fewer_nodes`);
- the shards of each phase: the manifest, the sequence length, every listed shard file present, the
  vocab present and equal to the manifest's (size and sha256), the same vocab for every phase, the MLM
  prediction slots; the model's vocab and position sizes against them. Shards are not hashed (rank 0
  does that at start-up, `data.verify_checksums`): this stays within seconds on any data size;
- the run folder and the checkpoint folder can be created and written, and their file systems hold the
  run's checkpoints and exports at their fullest (`checkpoint.keep_last` + 1 checkpoints, earlier phases'
  ends, the exports), estimated from the model, precision, ZeRO stage and ranks
  (pretrain/plan/footprint_plan.py; the line and `--dry-run` print the estimate).

Light on purpose: the standard library, numpy and pyarrow (the manifest reader); never torch or
DeepSpeed (tests/launch/test_preflight.py checks `sys.modules` in a fresh interpreter). The ranks run
the same functions again (pretrain/plan/run_plan.py `plan_run`, for the world size they really have: a SLURM
job may get another count, a plug-in may split the world), so a run started without launch.sh is
checked with the same messages, plus what needs torch (the optimizer's own parameter checks) and the
shards' checksums. Before `sbatch`, the same check runs on a login node:

    python -m pretrain.launch.preflight --world-size 32 [--nodes 3:4] --config RUN.json [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpointing.cadence import advised_interval
from pretrain.checkpointing.footprint import RunFootprint, check_free_space, model_fields
from pretrain.checkpointing.ownership import CheckpointClaim, check_checkpoint_dir
from pretrain.config.attention import setup_problem
from pretrain.config.cli import parse_args
from pretrain.config.deepspeed import phase_ds_config, phase_ds_json
from pretrain.config.load import load_config
from pretrain.config.sections import RunConfig
from pretrain.data.shard_checks import PhaseShards
from pretrain.errors import ConfigError, exit_on_error
from pretrain.launch.nodes import node_range
from pretrain.plan.footprint_plan import JobSizing, run_destinations, run_footprint
from pretrain.plan.shard_plan import check_run_shards, model_overrides
from pretrain.plugin_registry import plugin_spec


@dataclass(frozen=True)
class LaunchShape:
    """The job a launch will start, as far as the checks need it."""

    world_size: int  # ranks in the whole job
    device_type: str = "cuda"  # cpu with --cpu (it only picks the precision auto resolves to)
    ranks_per_node: int = 1
    fewer_nodes: tuple[int, ...] = ()  # --nodes MIN:MAX: the node counts below MAX a restart may run on

    @property
    def nodes(self) -> int:
        return self.world_size // max(self.ranks_per_node, 1)


def check_writable(path: Path, key: str) -> None:
    """`path` can be created and written: its nearest existing folder takes new entries.

    Rank 0 writes config.resolved.json at start-up and the first checkpoint much later; a read-only or
    mistyped folder is cheaper to hear about now. Nothing is created here.
    """
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is not a folder (the run writes {path} there)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {existing} is not writable (the run writes {path} there)")


def data_parallel_size(config: RunConfig, world_size: int) -> int | None:
    """The ranks one model's batch is split over: the world, or what a plug-in makes of it; None when an
    enabled plug-in does not say (then only its ranks can do the batch arithmetic)."""
    size = world_size
    for name, section in config.plugins.items():
        share = plugin_spec(name).data_parallel_size
        if share is None:
            return None
        try:
            size = share(section, size)
        except ValueError as err:  # a plug-in's own error names its key
            raise ConfigError(str(err)) from err
    return size


def check_fewer_nodes(config: RunConfig, shape: LaunchShape, full: dict[str, dict[str, Any]]) -> None:
    """--nodes MIN:MAX: a restart without a lost node must train the same steps, so every phase keeps its global
    batch (in sequences) on every node count from MIN up. ConfigError naming the phase, the node counts that fail
    and the setting that fixes it; otherwise the first restart on fewer nodes would end the job."""
    for name, phase in config.phases():
        batch = full[name]["train_batch_size"]
        failing: dict[int, str] = {}
        for nodes in shape.fewer_nodes:
            dp_size = data_parallel_size(config, nodes * shape.ranks_per_node)
            if dp_size is None:  # a plug-in that leaves the batch to the ranks
                continue
            try:
                ds = phase_ds_config(config, name, dp_size, shape.device_type, bf16_supported=True)
            except ConfigError as err:
                failing[nodes] = str(err).partition(": ")[2]
                continue
            if ds["train_batch_size"] != batch:
                failing[nodes] = f"{ds['train_batch_size']} sequences there"
        if failing:
            raise ConfigError(fewer_nodes_problem(name, phase.batch_size is None, shape, batch, failing))


def fewer_nodes_problem(name: str, derived_batch: bool, shape: LaunchShape, batch: int, failing: dict[int, str]) -> str:
    """The one line of check_fewer_nodes: what changes on which node counts, and the setting that fixes it."""
    low = min(shape.fewer_nodes)
    counts = ", ".join(str(nodes) for nodes in sorted(failing))
    why = "; ".join(f"{nodes} node(s): {text}" for nodes, text in sorted(failing.items()))
    if derived_batch:
        return (f"{name}.gradient_accumulation_steps: with --nodes {low}:{shape.nodes} a restart on {counts} node(s) "
                f"would change {name}'s global batch of {batch} sequences ({why}): it is micro_batch_size x "
                f"gradient_accumulation_steps x ranks; set {name}.batch_size={batch} and {name}.micro_batch_size and "
                f"leave {name}.gradient_accumulation_steps unset (derived for the ranks a restart has)")
    return (f"{name}.batch_size: with --nodes {low}:{shape.nodes} a restart on {counts} node(s) cannot keep {name}'s "
            f"global batch of {batch} sequences ({why}); choose a batch that {name}.micro_batch_size x the ranks of "
            f"every node count from {low} to {shape.nodes} divides, or a --nodes range whose counts do")


@dataclass(frozen=True)
class CheckedRun:
    """What passed: each phase's shards and, when the data-parallel size is known, its DeepSpeed dict."""

    shards: dict[str, PhaseShards]
    ds_configs: dict[str, dict[str, Any]] | None
    dp_size: int | None
    footprint: RunFootprint | None = None  # the disk the run needs at its fullest (None: dp size unknown)


def check_config(config: RunConfig, shape: LaunchShape) -> CheckedRun:
    """Every check of the module docstring on a loaded config, for a job of `shape`. ConfigError: the first problem."""
    dp_size = data_parallel_size(config, shape.world_size)
    ds_configs = None
    if dp_size is None:
        for name in config.run.phases:
            phase_ds_json(config, name)
    else:
        ds_configs = {name: phase_ds_config(config, name, dp_size, shape.device_type, bf16_supported=True)
                      for name in config.run.phases}
        for name, ds in ds_configs.items():
            problem = setup_problem(config, name, ds, shape.device_type)
            if problem is not None:
                raise ConfigError(problem)
        check_fewer_nodes(config, shape, ds_configs)
    shards = check_run_shards(config)
    first = shards[config.run.phases[0]]
    overrides, max_positions = model_overrides(config, first.vocab_size)
    check_writable(Path(config.run.dir), "run.dir")
    check_writable(config.checkpoint_dir, "checkpoint.dir" if config.checkpoint.dir else "run.dir")
    check_checkpoint_dir(CheckpointClaim(config.checkpoint_dir, Path(config.run.dir), config.checkpoint.adopt))
    footprint = None
    if ds_configs is not None and dp_size is not None:  # enough disk for keep_last + 1 checkpoints and the exports
        fields = model_fields(config.model.preset, overrides, first.vocab_size, max_positions)
        sizing = JobSizing(fields, first.manifest.vocab_path.stat().st_size, ds_configs, dp_size,
                           shape.world_size // dp_size)
        footprint = run_footprint(config, sizing)
        check_free_space(run_destinations(config, footprint))
    return CheckedRun(shards, ds_configs, dp_size, footprint)


def check_command_line(module_args: Sequence[str], shape: LaunchShape) -> str:
    """pretrain.train's arguments (as the ranks will get them) checked for `shape`; returns a one-line summary."""
    config_path, overrides = parse_args(list(module_args))
    config = load_config(config_path, overrides)
    checked = check_config(config, shape)
    parts = []
    for name, phase in config.phases():
        text = f"{name} seq {phase.seq_len}"
        if checked.ds_configs is not None:
            ds = checked.ds_configs[name]
            text += (f", batch {ds['train_batch_size']} = {ds['train_micro_batch_size_per_gpu']} x "
                     f"{ds['gradient_accumulation_steps']} accumulation x {checked.dp_size} ranks")
        parts.append(text)
    if checked.footprint is not None:
        parts.append(f"disk at most {checked.footprint.summary()}")
        parts.append(advised_interval(Path(config.run.dir), checked.footprint.checkpoint, shape.world_size))
    return f"checked {config_path} for {shape.world_size} rank(s): {'; '.join(parts)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.launch.preflight", description="Check a pretraining run before launching it (no GPU, "
        "no torch): config, DeepSpeed JSONs, batch arithmetic, shards, run folder. Exit 0, or 2 with one line.",
        epilog="Everything else is pretrain.train's command line: --config RUN.json [--section.key=value ...]")
    parser.add_argument("--world-size", type=int, default=1, help="ranks the job will have (nodes x GPUs per node)")
    parser.add_argument("--nodes", default="", help="MIN:MAX: also check a restart on MIN..MAX-1 nodes "
                        "(--world-size being MAX nodes x ranks per node)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks (precision auto = fp32)")
    args, module_args = parser.parse_known_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    low, high = node_range(args.nodes) or (1, 1)
    device = "cpu" if args.cpu else "cuda"
    shape = LaunchShape(args.world_size, device, args.world_size // high, tuple(range(low, high)))
    return exit_on_error(lambda: print(check_command_line(module_args, shape)), ConfigError, prefix="config error: ")


if __name__ == "__main__":
    sys.exit(main())
