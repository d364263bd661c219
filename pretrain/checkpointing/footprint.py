"""How much disk a run's checkpoints and exports take, estimated before any rank starts, and how much
there is. Standard library only: the launch-time check (pretrain/launch/preflight.py) runs it without torch.

What one checkpoint holds (DeepSpeed 0.19.8 with our files; measured on the tiny model, see
tests/checkpointing/test_footprint.py, which compares this estimate with checkpoints the tests write):

    model states      rank 0: the module in the compute precision (2 bytes a parameter in bf16/fp16,
                      4 in fp32); ZeRO-3: every rank a small file of placeholders instead
    optimizer         fp32 master weights (4 bytes; none at ZeRO-0 in fp32, where the module is the
                      master) and two moments (8 bytes: LAMB's or Adam's), split over the ranks
                      (ZeRO-1/2/3, BF16_Optimizer) or inside the model states (ZeRO-0)
    per rank          RNG states, the elastic layout record, the optimizer file's own structure
    per tag           trainer state, run config, MANIFEST.json
    codistillation    every group holds the other groups' weights (its teachers), in the compute precision

An export is the fp32 weights as safetensors (the tied decoder stored once) plus the tokenizer files.

What a run needs on a file system, at its fullest: `checkpoint.keep_last` step checkpoints, the one
being written (older ones are pruned only once it is whole), every earlier phase's end checkpoint
(never pruned), and every phase's export. What the run folder already holds (a resume) counts as
already paid for. That sum reads the run config (its phases, keep_last, the folders), so it sits on the plan's
floor (pretrain/plan/footprint_plan.py); this module sizes on plain values, which the save's space check
(commit.py) uses too.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError
from pretrain.model.presets import PRESETS, unknown_preset

KIB = 1024
MODULE_OVERHEAD = 16 * KIB  # torch.save's structure, buffers, DeepSpeed's bookkeeping in the model states
RANK_OVERHEAD = 24 * KIB  # RNG file (~17 KiB of tensors and plain values), optimizer file structure, layout record base
PER_TENSOR_PER_RANK = 160  # layout record and slice mappings: bytes per parameter tensor on every rank
ZERO3_PLACEHOLDERS = 32 * KIB  # ZeRO-3's per-rank model states (no weights, names and empty tensors)
TAG_OVERHEAD = 32 * KIB  # trainer state, run config, MANIFEST.json
EXPORT_OVERHEAD = 64 * KIB  # config, model card, export record, safetensors header


@dataclass(frozen=True)
class CheckpointShape:
    """What sizes one checkpoint: the model, its precision, ZeRO stage and ranks."""

    parameters: int  # distinct parameters of one model
    tensors: int  # parameter tensors of one model
    precision: str  # bf16 | fp16 | fp32 (the compute precision)
    zero_stage: int
    ranks: int  # data-parallel ranks of one model
    models: int = 1  # models the job trains at once (codistillation groups), each its own checkpoint


def checkpoint_bytes(shape: CheckpointShape) -> int:
    """Bytes of one checkpoint tag of every model of the job (module docstring)."""
    compute = 4 if shape.precision == "fp32" else 2
    n = shape.parameters
    module = n * compute + MODULE_OVERHEAD if shape.zero_stage < 3 else shape.ranks * ZERO3_PLACEHOLDERS
    master = 0 if shape.zero_stage == 0 and shape.precision == "fp32" else 4 * n
    per_rank = RANK_OVERHEAD + PER_TENSOR_PER_RANK * shape.tensors
    teachers = (shape.models - 1) * n * compute if shape.models > 1 else 0
    one_model = module + master + 8 * n + shape.ranks * per_rank + TAG_OVERHEAD + teachers
    return shape.models * one_model


def export_bytes(parameters: int, vocab_file_bytes: int, models: int = 1) -> int:
    """One phase's Hugging Face export(s): fp32 safetensors, vocab.txt and tokenizer.json (about twice the
    vocab file), config and model card."""
    return models * (4 * parameters + 3 * vocab_file_bytes + EXPORT_OVERHEAD)


@dataclass(frozen=True)
class RunFootprint:
    """A run's disk needs: one checkpoint, one phase's exports, and how many of each it holds at once."""

    checkpoint: int
    export: int
    checkpoints_at_peak: int  # keep_last + 1 being written + earlier phases' end checkpoints
    exports: int  # phases exported

    @property
    def checkpoint_total(self) -> int:
        return self.checkpoint * self.checkpoints_at_peak

    @property
    def export_total(self) -> int:
        return self.export * self.exports

    def summary(self) -> str:
        """One phrase for the launch-time check's line and `--dry-run`."""
        text = f"{self.checkpoints_at_peak} checkpoints x {human(self.checkpoint)}"
        if self.exports:
            text += f" + {self.exports} export{'s' * (self.exports > 1)} x {human(self.export)}"
        return text


def human(size: float) -> str:
    """Bytes for a person: 1.9 MiB, 5.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def existing_folder(path: Path) -> Path:
    """`path`, or its nearest folder that exists (where it will be created)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes a non-root user may still write on the file system that holds (or will hold) `path`."""
    return shutil.disk_usage(existing_folder(path)).free


def used_bytes(folder: Path) -> int:
    """Bytes the files under `folder` hold (0 when it does not exist yet)."""
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:  # deleted while we walk (a pruned tag)
                continue
    return total


@dataclass(frozen=True)
class Destination:
    """A folder the run writes into, the config key that names it (and that key's value), and what goes there."""

    key: str
    named: Path  # the key's folder, as the message shows it
    folder: Path
    needed: int  # bytes at the run's fullest
    what: str


def check_free_space(destinations: list[Destination]) -> None:
    """ConfigError (one line: the key, the folder, needed, free) when a file system cannot hold what the run
    will write there. Destinations on one file system add up; what the folders already hold is paid for."""
    by_device: dict[int, list[Destination]] = {}
    for destination in destinations:
        by_device.setdefault(existing_folder(destination.folder).stat().st_dev, []).append(destination)
    for group in by_device.values():
        needed = sum(d.needed for d in group)
        held = sum(used_bytes(d.folder) for d in group if not any(
            d.folder != other.folder and d.folder.is_relative_to(other.folder) for other in group))
        free = free_bytes(group[0].folder)
        if needed - held > free:
            where = " and ".join(dict.fromkeys(f"{d.key} {d.named}" for d in group))
            what = "; ".join(d.what for d in group)
            already = f", {human(held)} of it already there" if held else ""
            raise ConfigError(
                f"{where}: {human(free)} free on its file system, the run needs {human(needed)} ({what}{already}); "
                "free space, point the folder elsewhere or lower checkpoint.keep_last")


def parameter_tensors(fields: dict[str, int]) -> int:
    """Parameter tensors of BertForPreTraining: embeddings 5, 16 per layer, pooler 2, MLM head 5, NSP 2."""
    return 14 + 16 * fields["num_hidden_layers"]


def model_fields(preset: str, overrides: dict[str, Any], vocab_size: int, max_positions: int) -> dict[str, int]:
    """The BertConfig fields that size the model: the preset's, model.overrides over them, the shards' vocab."""
    if preset not in PRESETS:
        raise ConfigError(unknown_preset(preset))
    return {**PRESETS[preset], **overrides, "vocab_size": vocab_size, "max_position_embeddings": max_positions}
