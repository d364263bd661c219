"""Which run a checkpoint folder belongs to: one run resumes from and prunes a `checkpoint.dir`, never two.

Only `run.dir` used to be locked, so a config copied for a second experiment with the same scratch
`checkpoint.dir` resumed from the first run's weights, deleted its checkpoints by keep-last and flipped its
`latest`. Now the job's rank 0 (pretrain/plan/run_plan.py, beside the run folder's lock, before anything is
written) claims the folder:

- it takes the folder's own flock for the job's life (pretrain/distributed/lifetime.py): a live job elsewhere
  keeps it, and the second is refused in one line naming the holder;
- it reads the folder's owner record (`run_owner.json`: the run folder, and where the checkpoint folder sat in
  it). Another run's record is refused in one line unless `checkpoint.adopt=true` takes the folder over (said
  in one line). A checkpoint folder that moved or was copied together with its run folder (it sits at the
  same place inside the new one, the default `<run.dir>/checkpoints` for instance) stays that run's;
- a folder without a record (new, or written before this release) becomes this run's; one that already
  holds checkpoints says so in one line.

The record is written atomically and only when it changes. `./launch.sh pretrain` asks the same question before
any rank starts (`check_checkpoint_dir`, pretrain/launch/preflight.py), so a refusal does not wait for the shards'
hashing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.checkpointing.layout import CHECKPOINT_LOCK, LATEST, OWNER, TAG_PATTERN
from pretrain.distributed.lifetime import hold_checkpoint_folder, release_folder
from pretrain.errors import ConfigError


class CheckpointDirTakenError(ConfigError):
    """The checkpoint folder belongs to another run (its owner record says which)."""


@dataclass(frozen=True)
class CheckpointClaim:
    """What a job claims: its checkpoint folder for its run folder, and whether it may take over another's."""

    checkpoint_dir: Path
    run_dir: Path
    adopt: bool = False  # checkpoint.adopt


def claim_checkpoint_dir(claim: CheckpointClaim) -> None:
    """Rank 0 of a job, before anything is written there: lock `claim.checkpoint_dir` for this process's life
    and make it this run's (see the module docstring). Raises CheckpointDirTakenError or RunFolderBusyError,
    both one line; a refused claim leaves the folder as it was and unlocked."""
    folder, run = Path(claim.checkpoint_dir).resolve(), Path(claim.run_dir).resolve()
    existed = folder.is_dir()
    hold_checkpoint_folder(folder, run, CHECKPOINT_LOCK)  # creates the folder when new
    try:
        record, line = _decide(folder, run, claim.adopt, existed)
    except CheckpointDirTakenError:
        release_folder(folder)
        raise
    if line:
        print(line, flush=True)
    if record is not None:
        atomic_write_json(folder / OWNER, record)


def check_checkpoint_dir(claim: CheckpointClaim) -> None:
    """The claim's verdict without taking anything (the launch-time check, before any rank starts and before the
    shards are hashed): CheckpointDirTakenError when another run's record names the folder. Writes nothing."""
    folder = Path(claim.checkpoint_dir).resolve()
    if folder.is_dir():
        _decide(folder, Path(claim.run_dir).resolve(), claim.adopt, existed=True)


def _decide(folder: Path, run: Path, adopt: bool, existed: bool) -> tuple[dict[str, str | None] | None, str | None]:
    """The record to write (None: the folder is this run's already) and the line that says a change of hands."""
    place = str(folder.relative_to(run)) if folder.is_relative_to(run) else None
    ours = {"run_dir": str(run), "place_in_run_dir": place}
    path = folder / OWNER
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
        owner, owner_place = str(recorded["run_dir"]), recorded.get("place_in_run_dir")
    except FileNotFoundError:
        if existed and _holds_checkpoints(folder):
            return ours, (f"checkpoint.dir {folder}: no {OWNER} (written before runs recorded their checkpoint "
                          f"folder): now run {run}'s")
        return ours, None
    except (OSError, ValueError, KeyError, TypeError) as err:
        if not adopt:
            raise CheckpointDirTakenError(
                f"checkpoint.dir {folder}: its owner record {path} is unreadable ({err}): set checkpoint.adopt=true "
                "if this run may take the folder over, or use another checkpoint.dir") from None
        return ours, f"checkpoint.dir {folder}: owner record unreadable; adopted by run {run} (checkpoint.adopt)"
    if owner == str(run):
        return None, None
    if place is not None and owner_place == place:
        return ours, (f"checkpoint.dir {folder}: recorded for run {owner}; it moved or was copied with its run "
                      f"folder: now run {run}'s")
    if not adopt:
        raise CheckpointDirTakenError(
            f"checkpoint.dir {folder} belongs to run {owner} (its {OWNER}): this run would resume from and prune "
            "that run's checkpoints; use another checkpoint.dir, or set checkpoint.adopt=true to take it over")
    return ours, f"checkpoint.dir {folder}: taken over from run {owner} by run {run} (checkpoint.adopt)"


def _holds_checkpoints(folder: Path) -> bool:
    return (folder / LATEST).exists() or any(TAG_PATTERN.fullmatch(p.name) for p in folder.iterdir())
