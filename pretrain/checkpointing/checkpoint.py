"""Resume checkpoints: DeepSpeed save/load, our trainer state beside it, an atomic `latest`, keep-last-k.

Layout of `checkpoint.dir`::

    latest                         tag of the newest COMPLETE checkpoint (rewritten atomically, last)
    phase1-step0000200/            one DeepSpeed checkpoint per tag (model states, ZeRO partitions)
        trainer_state.json         phase, step, samples seen, data position, counters (rank 0)
        run_config.json            the resolved run configuration (rank 0)
        rng_rank00000.pt           each rank's torch / numpy / python RNG states, as tensors (rng_state.py)
        elastic_layout_rank00000.json  where each rank's flat partitions hold which parameter slices
        MANIFEST.json              every file's size and sha256 (pretrain/checkpointing/manifest.py)
        elastic_state.pt           only after a resume on another world size: the world-size-free state
        PHASE_END                  present on the checkpoint that closes a phase (never pruned)
        codistill_teachers.pt      a plug-in's `state_dict()` under its `state_file` name (rank 0 of the model)

The names are pretrain/checkpointing/layout.py's (the on-disk format).

Why our own `latest`: DeepSpeed's rank 0 writes its `latest` with a plain open() before the final
barrier of `save_checkpoint`, so a crash can leave it naming a tag other ranks never finished. We pass
`save_latest=False`; every file is written by temp file + fsync + rename, the manifest (the commit
marker) and then `latest` only after every rank reported its files written, and a rank whose write
fails fails the save on every rank (pretrain/checkpointing/commit.py). Older tags are pruned only after
the switch: renamed aside before the last collective (one rename each), deleted by rank 0 after it, so
no rank waits for the deletion.

Another world size: `load` of a tag written by a different number of ranks puts the converted state
(pretrain/checkpointing/elastic.py; the driver converts once before loading) into the new engine instead of
DeepSpeed's own loader, which needs the same partitioning.

Every file is read as data (`weights_only=True` with one allowlist, pretrain/checkpointing/safe_load.py):
DeepSpeed's own loads through `deepspeed_load` (commit.py), the consolidation through consolidate.py, the RNG
files through rng_state.py. A file that needs anything else is refused in one line naming it and the type.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from data_prep.shard_format.atomic_io import atomic_write_bytes, atomic_write_json, fsync_folder
from pretrain.checkpointing.commit import (
    SaveAttempt,
    SaveError,
    agree_on_failures,
    deepspeed_load,
    deepspeed_save,
    publish,
    report_failure,
)
from pretrain.checkpointing.consolidate import consolidated_state_dict
from pretrain.checkpointing.elastic import load_converted, write_layout_record
from pretrain.checkpointing.layout import (
    CONSOLIDATED,
    LATEST,
    MANIFEST,
    PHASE_END,
    PRUNED_PREFIX,
    RUN_CONFIG,
    TAG_PATTERN,
    TRAINER_STATE,
    make_tag,
)
from pretrain.checkpointing.manifest import gather_entries, read_latest, write_manifest
from pretrain.checkpointing.rng_state import read_rng, restore, rng_file_name, write_rng
from pretrain.checkpointing.safe_load import load_data

__all__ = ["CheckpointManager", "SaveError", "SavedState", "consolidated_state_dict", "make_tag", "read_run_config",
           "record_tied_parameters", "split_checkpoint_path"]


class SavedState(Protocol):
    """State saved beside the engine's in every tag (a TrainingPlugin's teachers): torchtitan's `states`."""

    state_file: str | None

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int, rank: int, extra_state: SavedState | None = None,
                 progress: Callable[[], None] = lambda: None) -> None:
        """`rank`: this process's rank in its job (its model's ranks); `extra_state`: saved in its `state_file`
        of every tag (a plug-in's state), read back on load; `progress`: told after each file a save writes (the
        hang timer's clock: pretrain/distributed/step_watch.py)."""
        self.root, self.keep_last, self.rank, self.progress = Path(root), keep_last, rank, progress
        self.extra_state = extra_state if extra_state is not None and extra_state.state_file else None
        self.hash_seconds = 0.0  # this rank's sha256 time at the last save (the manifest's cost)

    def latest_tag(self) -> str | None:
        """The tag `latest` names (None: missing, empty or unreadable). One that is no tag folder directly inside
        the checkpoint folder (an absolute path, `..`, a symbolic link) is refused: PointerError names both."""
        tag = read_latest(self.root).tag
        if tag is None:
            return None
        if not (self.root / tag / TRAINER_STATE).is_file():
            raise FileNotFoundError(f"{self.root / LATEST} names {tag!r}, but {self.root / tag / TRAINER_STATE} "
                                    "is missing")
        return tag

    def trainer_state(self, tag: str) -> dict[str, Any]:
        return json.loads((self.root / tag / TRAINER_STATE).read_text(encoding="utf-8"))

    def save(self, engine: Any, tag: str, trainer_state: dict[str, Any], run_config: dict[str, Any],
             phase_end: bool, may_fail: bool = False) -> Path | None:
        """Collective: every rank calls it. Returns the tag folder once `latest` names it.

        A write that fails on any rank fails the save on every rank (pretrain/checkpointing/commit.py): the
        folder is deleted, `latest` keeps naming the last whole checkpoint, rank 0 prints one line. Then
        `may_fail` (a routine step checkpoint) returns None and training goes on; otherwise SaveError.
        """
        folder = self.root / tag
        attempt = SaveAttempt(self.rank, self.progress)
        if self.rank == 0:  # a tag saved again (after a manual rollback) must not keep an older conversion
            attempt.write(CONSOLIDATED, lambda: (folder / CONSOLIDATED).unlink(missing_ok=True))
            attempt.write("plug-in state", lambda: self._write_extra_state(folder))  # `latest` never lacks it
        client_state = {"trainer_state": trainer_state, "run_config": run_config}
        deepspeed_save(engine, attempt, lambda: engine.save_checkpoint(
            str(self.root), tag=tag, client_state=client_state, save_latest=False))
        self._write_own_files(engine, folder, attempt, trainer_state, run_config, phase_end)
        attempt.write(folder.name, lambda: fsync_folder(folder))  # this rank's renames are durable
        world = run_config.get("resolved", {}).get("world_size", 1)
        gathered = gather_entries(folder, self.rank, attempt.failure)  # collective; files + sizes + sha256
        self.hash_seconds = gathered.seconds
        pruned: list[Path] = []
        if self.rank == 0 and not gathered.failures:
            attempt.write(MANIFEST, lambda: write_manifest(folder, gathered.files, world))  # the commit marker
            publish(self.root, tag, attempt)  # `latest`, last
            if attempt.failure is None:
                pruned = self.set_aside_old_tags(keep=tag)  # renames only: the folder holds keep-last from here
        failures = gathered.failures or agree_on_failures(attempt.failure)  # collective (all agree on the first)
        if failures:
            line = report_failure(folder, failures, engine, self.rank, stop=not may_fail)
            if may_fail:
                return None
            raise SaveError(line)
        self.delete_set_aside(pruned)  # rank 0, after the last collective: no rank waits for the deletion
        return folder

    def _write_own_files(self, engine: Any, folder: Path, attempt: SaveAttempt, trainer_state: dict[str, Any],
                         run_config: dict[str, Any], phase_end: bool) -> None:
        """Our files beside DeepSpeed's, each written atomically; a failure is recorded in `attempt`."""
        # Each rank's RNG: not needed for exactness (steps reseed), kept so anything else random resumes too.
        rng_file = folder / rng_file_name(self.rank)
        attempt.write(rng_file.name, lambda: atomic_write_bytes(rng_file, write_rng(rng_file)))
        if isinstance(getattr(engine, "basic_optimizer", None), torch.optim.Optimizer):
            attempt.write("elastic layout record", lambda: write_layout_record(engine, folder, self.rank))
        if self.rank == 0:
            attempt.write(TRAINER_STATE, lambda: atomic_write_json(folder / TRAINER_STATE, trainer_state))
            attempt.write(RUN_CONFIG, lambda: atomic_write_json(folder / RUN_CONFIG, run_config))
            if phase_end:
                attempt.write(PHASE_END, lambda: atomic_write_bytes(folder / PHASE_END, b""))
        if self.rank == 0 and dist.is_initialized() and dist.get_rank() != 0:
            # a model whose first rank is not world rank 0 (a codistillation group): patched before the files
            # are hashed and before anyone (world rank 0 exporting every group) reads them
            attempt.write("shared parameters", lambda: record_tied_parameters(engine.module, folder))

    def _write_extra_state(self, folder: Path) -> None:
        if self.extra_state is None:
            return
        buffer = io.BytesIO()
        torch.save(self.extra_state.state_dict(), buffer)
        atomic_write_bytes(folder / self.extra_state.state_file, buffer.getvalue())

    def _read_extra_state(self, tag: str) -> None:
        if self.extra_state is None:
            return
        path = self.root / tag / self.extra_state.state_file
        if not path.is_file():
            raise FileNotFoundError(f"{path}: this run's plug-in keeps its state there, and the checkpoint lacks it")
        self.extra_state.load_state_dict(load_data(path))

    def load(self, engine: Any, tag: str) -> dict[str, Any]:
        """Weights, optimizer, lr-scheduler position, RNG; returns the trainer state saved with them."""
        saved_world = read_run_config(self.root, tag)["resolved"]["world_size"]
        if saved_world != getattr(engine, "dp_world_size", saved_world):
            load_converted(engine, self.root / tag / CONSOLIDATED)  # per-rank RNG states do not carry over
            self._read_extra_state(tag)
            return self.trainer_state(tag)
        rng_file = self.root / tag / rng_file_name(self.rank)
        rng = read_rng(rng_file) if rng_file.is_file() else None  # read (and checked) before the engine's state
        path, _ = deepspeed_load(engine, lambda: engine.load_checkpoint(
            str(self.root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True))
        if path is None:
            raise FileNotFoundError(f"{self.root / tag}: DeepSpeed could not load this checkpoint")
        if rng is not None:
            restore(rng)
        self._read_extra_state(tag)
        return self.trainer_state(tag)

    def set_aside_old_tags(self, keep: str) -> list[Path]:
        """Rank 0: keep the newest `keep_last` step checkpoints (and every phase end, and `keep`); rename the
        rest to `.pruned-<tag>-<n>` folders, one atomic rename each, and return those (plus any a crash left).

        Renamed first, deleted later: a half-deleted folder keeps no tag name, so the resume fallback
        (pretrain/checkpointing/manifest.py) can never take one for a checkpoint, and the deletion itself
        (hundreds of files) can run after the final barrier of the save.
        """
        tags, leftovers = [], []
        for child in self.root.iterdir():
            match = TAG_PATTERN.match(child.name)
            if child.name.startswith(PRUNED_PREFIX):
                leftovers.append(child)
            elif match and child.is_dir() and not (child / PHASE_END).exists() and child.name != keep:
                tags.append((match.group(1), int(match.group(2)), child))
        tags.sort()
        aside = []
        for *_, folder in tags[: max(0, len(tags) - (self.keep_last - 1))]:
            target = self.root / f"{PRUNED_PREFIX}{folder.name}-0"
            while target.exists():  # the same tag pruned again while an older copy is still being deleted
                stem, count = target.name.rsplit("-", 1)
                target = self.root / f"{stem}-{int(count) + 1}"
            os.replace(folder, target)
            aside.append(target)
        return [*aside, *leftovers]

    @staticmethod
    def delete_set_aside(folders: list[Path]) -> None:
        """Delete folders `set_aside_old_tags` renamed (whatever a crash left of them too)."""
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def split_checkpoint_path(path: str | Path) -> tuple[Path, str]:
    """A checkpoint root (with `latest`) or one tag folder -> (root, tag). A `latest` that names no tag folder
    directly inside the root is refused (PointerError): an absolute or `../` value would load another folder."""
    path = Path(path)
    if (path / LATEST).is_file():
        pointer = read_latest(path)
        if pointer.tag is None:
            raise FileNotFoundError(f"{path / LATEST} is {pointer.problem}: name the checkpoint's tag folder instead")
        return path, pointer.tag
    if path.is_dir() and any(path.glob("*model_states.pt")):
        return path.parent, path.name
    raise FileNotFoundError(f"{path}: neither a checkpoint folder with a 'latest' file nor a checkpoint tag folder")


def read_run_config(root: Path, tag: str) -> dict[str, Any]:
    return json.loads((root / tag / RUN_CONFIG).read_text(encoding="utf-8"))


def record_tied_parameters(module: torch.nn.Module, folder: Path) -> None:
    """Write the tied-parameter map DeepSpeed 0.19.8 records only on world rank 0 (engine.py:5525).

    Without it `zero_to_fp32` drops tied weights (e.g. `cls.predictions.decoder.bias`) from every model
    whose first rank is not world rank 0, and the export refuses the checkpoint. Same convention as
    DeepSpeed: the first name in module order holds the data, later names map to it.
    """
    holder: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in holder:
            shared[name] = holder[id(param)]
        else:
            holder[id(param)] = name
    for path in folder.glob("*model_states.pt"):
        states = load_data(path)
        if states.get("shared_params") == shared:
            continue
        states["shared_params"] = shared
        buffer = io.BytesIO()
        torch.save(states, buffer)
        atomic_write_bytes(path, buffer.getvalue())
