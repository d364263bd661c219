"""Where a run's weights come from, and the proof that they were trained on the same vocab as the shards it reads.

A phase starts from a checkpoint of this run (resume), from another run's checkpoint or a Hugging Face export of
this toolkit (`init_from`). Token id 2,345 means a word only through the vocab the weights were trained with: weights
read with shards of another vocab train on noise, and nothing fails. So each source's vocab sha256 (the run config a
checkpoint carries, an export's export_info.json) is compared with the shards' before any weight is read, and a
difference is refused in one line that names both vocabs. The weights themselves are read as data: a checkpoint's
files with `weights_only=True` and one allowlist (safe_load.py), an export's safetensors only; by a model's
first rank alone, which hands them to the others (load_initial_weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import BertConfig

from pretrain.checkpointing.checkpoint import consolidated_state_dict, read_run_config, split_checkpoint_path
from pretrain.checkpointing.export import folder_class, load_weights
from pretrain.checkpointing.safe_load import UnsafeCheckpointError
from pretrain.distributed.info import DistInfo
from pretrain.distributed.json_collectives import broadcast_json
from pretrain.errors import ConfigError
from pretrain.run_folder import EXPORT_INFO


@dataclass(frozen=True)
class VocabIdentity:
    """A vocab as a run records it (the resolved block of its run config): the file and its sha256."""

    sha256: str
    file: str

    @classmethod
    def of(cls, resolved: dict[str, Any]) -> VocabIdentity:
        return cls(str(resolved["vocab_sha256"]), str(resolved.get("vocab_file", "?")))

    def __str__(self) -> str:
        return f"{self.file} (sha256 {self.sha256[:12]})"


def refuse_other_vocab(source: str, theirs: VocabIdentity, shards: VocabIdentity, what: str) -> None:
    """One line naming both vocabs when `source` (weights) was trained with another vocab than the shards'."""
    if theirs.sha256 != shards.sha256:
        raise ConfigError(f"{what}: {source} was trained with the vocab {theirs}, the shards use {shards}; use the "
                          f"shards it was trained on, or other weights")


def check_checkpoint_vocab(root: Path, tag: str, shards: VocabIdentity, what: str) -> None:
    """Refuse a checkpoint trained with another vocab than the shards'; `what` names the key or the action."""
    refuse_other_vocab(str(root / tag), VocabIdentity.of(read_run_config(root, tag)["resolved"]), shards, what)


def initial_weights(path: str, shards: VocabIdentity, key: str) -> dict[str, torch.Tensor]:
    """fp32 weights from a checkpoint (folder or tag) or a Hugging Face export of this toolkit."""
    folder = Path(path)
    if (folder / "config.json").is_file():
        info = folder / EXPORT_INFO
        if info.is_file():
            sha = json.loads(info.read_text(encoding="utf-8")).get("vocab_sha256")
            if sha:
                refuse_other_vocab(path, VocabIdentity(sha, str(folder / "vocab.txt")), shards, key)
        # the class it was saved as: an MLM-only export has no NSP head to load (load_weights says so if one is needed)
        saved_as = folder_class(BertConfig.from_pretrained(str(folder), local_files_only=True))
        # safetensors only (what an export writes): a pickled pytorch_model.bin is never read from here
        return saved_as.from_pretrained(str(folder), local_files_only=True, use_safetensors=True).state_dict()
    try:
        root, tag = split_checkpoint_path(folder)
    except FileNotFoundError as err:
        raise ConfigError(f"{key}: {err}") from err
    check_checkpoint_vocab(root, tag, shards, key)
    try:
        return consolidated_state_dict(root, tag)  # every file read as data (safe_load.py)
    except UnsafeCheckpointError as err:
        raise ConfigError(f"{key}: {err}") from None


WeightReader = Callable[[], dict[str, torch.Tensor]]  # reads a phase's initial fp32 weights from disk


def load_initial_weights(
    model: torch.nn.Module, read: WeightReader, source: str, dist_info: DistInfo, src: int, group: Any
) -> None:
    """The model's first rank reads (and consolidates) the weights once; the other ranks receive them.

    Every rank reading a phase-1 checkpoint itself would make N ranks each read every rank's partition
    (an I/O storm of N x checkpoint size on a shared file system at 256 ranks). A read error is
    shared first, so all ranks fail together with the same message. `src` is the global rank of this
    model's first rank, `group` its process group (None: the world).
    """
    error: str | None = None
    if dist_info.rank == 0:
        try:
            load_weights(model, read(), source)
        except (ConfigError, FileNotFoundError, ValueError) as err:
            error = str(err)
    if dist_info.world_size > 1 and dist.is_initialized():
        error = broadcast_json(error, src=src, group=group)  # as JSON: never unpickled
    if error is not None:
        raise ConfigError(error)
    if dist_info.world_size > 1 and dist.is_initialized():
        model.to(dist_info.device)  # NCCL broadcasts device tensors; the engine would move it there anyway
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=src, group=group)
