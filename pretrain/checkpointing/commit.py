"""How a checkpoint save commits, or fails as one: on every rank, with `latest` left on the last whole one.

The pattern of PyTorch DCP and torchtitan (a checkpoint counts once its metadata is committed by temp
file, fsync and rename, after every rank wrote), for DeepSpeed's files. One save
(pretrain/checkpointing/checkpoint.py `CheckpointManager.save`):

1. Every rank writes its files. DeepSpeed's go through `DurableWrites`, installed as the engine's
   checkpoint engine for the save: each file to a temp file, fsynced, renamed (DeepSpeed's own engine
   writes in place and never fsyncs). Ours are written the same way (data_prep/shard_format/atomic_io.py). A write
   that fails (ENOSPC, EIO, a quota) is recorded in the rank's `SaveAttempt` instead of raised: the
   rank's later writes are skipped, and it still reaches every collective of the save, so no rank is
   left waiting in a barrier for one that left.
2. Each rank fsyncs the tag folder: its renames are durable.
3. One all-gather brings every rank's manifest entries and its failure, if any, to every rank
   (pretrain/checkpointing/manifest.py): a rank whose write failed makes the save fail on every rank.
4. With no failure anywhere, rank 0 writes MANIFEST.json, the commit marker (temp, fsync, rename,
   folder fsync), then `latest` (the same, then the root folder's fsync). Only then are old tags pruned.
5. A second all-gather shares whether rank 0 managed that.

A failed save: rank 0 moves the tag folder aside and deletes it (the space comes back, and the next try
starts clean), prints one line (the folder, the failure, the space a checkpoint needs, the space left,
the checkpoint `latest` still names), and every rank either trains on (a routine step checkpoint: the
next one tries again) or stops with `SaveError` (a checkpoint the run cannot do without: a phase end,
a stop; exit 4). docs/faults.md describes what the user sees.

Loads go the other way through the same seam: `deepspeed_load` installs `SafeLoads` over the engine's checkpoint
engine for a resume's `load_checkpoint`, so DeepSpeed's own reads are data-only too (safe_load.py).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_prep.shard_format.atomic_io import atomic_write_bytes, atomic_write_stream, fsync_folder
from pretrain.checkpointing.footprint import CheckpointShape, checkpoint_bytes, free_bytes, human
from pretrain.checkpointing.layout import LATEST, PRUNED_PREFIX
from pretrain.checkpointing.manifest import manifest_bytes
from pretrain.checkpointing.safe_load import load_data
from pretrain.distributed.json_collectives import all_gather_json
from pretrain.errors import EXPORT_ERROR_PREFIX, SAVE_ERROR_PREFIX, UserError

__all__ = ["ExportError", "SaveAttempt", "SaveError", "agree_on_failures", "deepspeed_load", "deepspeed_save", "publish",
           "report_failure"]

# What a failed write raises: OSError from Python's I/O, RuntimeError from torch.save's writer ("file write failed")
WRITE_ERRORS = (OSError, RuntimeError)


class SaveError(UserError):
    """A checkpoint the run cannot do without (a phase end, a stop) could not be written on some rank; `latest` names
    the last whole checkpoint. Rank 0's message is the whole line (what failed where, and what to do), which the
    driver prints once, to stderr, and exits 4: the elastic agent shows it from the rank's log."""

    prefix = SAVE_ERROR_PREFIX


class ExportError(SaveError):
    """A phase end's Hugging Face export that could not be written (its checkpoint is whole); exit 4 as well."""

    prefix = EXPORT_ERROR_PREFIX


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# A full disk or a quota: Python's and Rust's (safetensors) words for the errno. Only these get "free space" advice.
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_ERRNO = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)")


def out_of_space(failure: str) -> bool:
    """Whether a failure's text (an OSError's or safetensors' words, carried as text between ranks) says the file
    system is full or a quota is spent: the one failure that freeing space fixes."""
    return any(int(a or b) in SPACE_ERRNOS for a, b in _ERRNO.findall(failure))


def first_line(err: BaseException, limit: int = 160) -> str:
    """An exception in one short phrase (torch's write errors span lines and name C++ sources)."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SaveAttempt:
    """One rank's writes of one tag: `write` runs each, keeps the first failure (naming the file) and skips
    every later write, so the rank goes on to the save's collectives instead of leaving them."""

    def __init__(self, rank: int, progress: Callable[[], None] = lambda: None) -> None:
        self.rank, self.progress = rank, progress  # progress: told after each write (the hang timer's clock)
        self.failure: str | None = None

    def write(self, name: str, action: Callable[[], object]) -> None:
        if self.failure is not None:
            return
        try:
            action()
        except WRITE_ERRORS as err:
            self.fail(name, err)
        else:
            self.progress()

    def fail(self, name: str, err: BaseException) -> None:
        self.failure = self.failure or f"rank {self.rank}: {name}: {first_line(err)}"


class WatchedHandle:
    """A file handle that remembers the first OSError of its writes (ENOSPC, EIO), which torch.save replaces
    by a RuntimeError of its own."""

    def __init__(self, handle: Any) -> None:
        self._handle, self.error = handle, None

    def write(self, data: Any) -> int:
        try:
            return self._handle.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class SafeLoads:
    """DeepSpeed's checkpoint engine with its `load` reading each file as data (safe_load.py): DeepSpeed 0.19.8's
    TorchCheckpointEngine.load passes `weights_only=False`, and every file its `load_checkpoint` reads (model
    states, ZeRO partitions, BF16_Optimizer files) goes through the engine's `load`. Everything else is the
    wrapped engine's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_data(path, map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class DurableWrites(SafeLoads):
    """DeepSpeed's TorchCheckpointEngine for one save, each file written by temp file + fsync + rename, a
    failed write recorded in the attempt instead of raised (and any load of the save's as data)."""

    def __init__(self, inner: Any, attempt: SaveAttempt) -> None:
        super().__init__(inner)
        self._attempt = attempt

    def save(self, state_dict: Any, path: str) -> None:
        zipfile = self._inner.zipfile_serialization

        def write(handle: Any) -> None:
            watched = WatchedHandle(handle)
            try:
                torch.save(state_dict, watched, _use_new_zipfile_serialization=zipfile)
            except RuntimeError as err:  # torch's writer words a failed write as "unexpected pos ...": name the cause
                raise (watched.error or err) from err

        self._attempt.write(Path(path).name, lambda: atomic_write_stream(path, write))


def deepspeed_save(engine: Any, attempt: SaveAttempt, save: Callable[[], object]) -> None:
    """Run `save` (the engine's save_checkpoint) with `DurableWrites` installed.

    DeepSpeed 0.19.8's save_checkpoint runs two collectives before writing (a barrier, the tag check) and one
    after (its final barrier), with only writes between them. The one write that does not go through the
    checkpoint engine is rank 0's copy of zero_to_fp32.py into the checkpoint folder; an OSError there leaves
    save_checkpoint before its final barrier, so this rank joins that barrier here. A custom checkpoint
    engine (DeepSpeed's `checkpoint` config) is left as it is: its writes are its own.
    """
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # loaded by the engine already

    inner = engine.checkpoint_engine
    if type(inner) is TorchCheckpointEngine:
        engine.checkpoint_engine = DurableWrites(inner, attempt)
    try:
        save()
    except OSError as err:
        attempt.fail("zero_to_fp32.py", err)
        barrier()  # stands in for save_checkpoint's final barrier, which this rank left before
    finally:
        engine.checkpoint_engine = inner


def deepspeed_load(engine: Any, load: Callable[[], Any]) -> Any:
    """Run `load` (the engine's load_checkpoint) with `SafeLoads` installed over whatever checkpoint engine the
    engine has (a custom one's load is DeepSpeed's torch.load too); returns what `load` returns."""
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = SafeLoads(inner)
    try:
        return load()
    finally:
        engine.checkpoint_engine = inner


def agree_on_failures(failure: str | None) -> list[str]:
    """Collective over the world: every rank's failure (None: all its writes went through), the failed ones."""
    gathered: list[Any] = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = all_gather_json(failure)  # as JSON: a peer's bytes are never unpickled
    return [f for f in gathered if f]


def publish(root: Path, tag: str, attempt: SaveAttempt) -> None:
    """Rank 0, after every rank's files and the manifest are durable: `latest` names `tag` (temp, fsync,
    rename, then the root folder's fsync)."""
    def write() -> None:
        atomic_write_bytes(root / LATEST, tag.encode("utf-8"))
        fsync_folder(root)

    attempt.write(LATEST, write)


def pointer(root: Path) -> str | None:
    path = root / LATEST
    return path.read_text(encoding="utf-8").strip() if path.is_file() else None


def needed_bytes(root: Path, engine: Any) -> int:
    """What a checkpoint takes: the last whole one's size (its manifest), else the estimate for the engine."""
    last = pointer(root)
    recorded = manifest_bytes(root / last) if last else None
    if recorded:
        return recorded
    parameters = {id(p): p for p in engine.module.parameters()}.values()
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    shape = CheckpointShape(sum(getattr(p, "ds_numel", p.numel()) for p in parameters), len(parameters), precision,
                            engine.zero_optimization_stage(), engine.dp_world_size)
    return checkpoint_bytes(shape)


def discard(folder: Path) -> None:
    """Rank 0: a failed tag's folder goes (renamed aside first: a half-deleted folder keeps no tag name). The
    one `latest` names never does: that is a re-save of the last whole checkpoint, whose manifest then tells."""
    if not folder.is_dir() or pointer(folder.parent) == folder.name:
        return
    aside = folder.parent / f"{PRUNED_PREFIX}{folder.name}-failed"
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


def report_failure(folder: Path, failures: list[str], engine: Any, rank: int, stop: bool) -> str:
    """Every rank, after a failed save: rank 0 discards the folder and prints the one line, then a barrier
    (the line is out before any rank can exit). Returns the line's text (SaveError's message; rank 0's also gives
    the sizes)."""
    root = folder.parent
    more = f" (and {len(failures) - 1} more rank{'s' * (len(failures) > 2)})" if len(failures) > 1 else ""
    last = pointer(root)
    space = out_of_space(failures[0])
    fix = "free space" if space else "remove the cause of that error"
    then = (f"stopping: {fix}, then rerun the same command (it resumes from there)" if stop
            else "training on: the next checkpoint tries again")
    sizes = ""
    if rank == 0:
        discard(folder)
        sizes = (f"a checkpoint needs about {human(needed_bytes(root, engine))}, {human(free_bytes(root))} is free "
                 "there; " if space else "")
    # every rank's words say what to do: the agent may show any rank's (the earliest failure), not rank 0's
    text = (f"could not write {folder} ({failures[0]}{more}); {sizes}latest still names "
            f"{last or 'nothing (no checkpoint yet)'}; {then}")
    if rank == 0 and not stop:  # training goes on: said here; a stop's line is the SaveError's (driver's or agent's)
        print(f"{SaveError.prefix}{text}", flush=True)
    barrier()
    return text
