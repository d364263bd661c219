"""Which run a checkpoint folder belongs to (pretrain/checkpointing/ownership.py), decided on real folders and a
real flock: the driver-level refusal is tests/checkpointing/test_foreign_folders.py."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from pretrain.checkpointing.layout import CHECKPOINT_LOCK, OWNER
from pretrain.checkpointing.ownership import CheckpointClaim, CheckpointDirTakenError, claim_checkpoint_dir
from pretrain.distributed.lifetime import RunFolderBusyError, release_run_folder
from tests.checkpointing.test_elastic_units import fake_checkpoint


def claim(checkpoints: Path, run: Path, adopt: bool = False) -> None:
    try:
        claim_checkpoint_dir(CheckpointClaim(checkpoints, run, adopt))
    finally:
        release_run_folder(run)  # the lock lives as long as the job; here, as long as the call


def owner(checkpoints: Path) -> str:
    return json.loads((checkpoints / OWNER).read_text())["run_dir"]


def test_a_shared_scratch_folder_is_refused_then_adopted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    scratch, first, second = tmp_path / "scratch" / "ckpt", tmp_path / "a", tmp_path / "b"
    claim(scratch, first)
    assert owner(scratch) == str(first.resolve()) and capsys.readouterr().out == ""  # a new folder: silent
    claim(scratch, first)  # the same run again (a resume): nothing to say
    with pytest.raises(CheckpointDirTakenError, match=rf"^checkpoint.dir {scratch} belongs to run {first}"):
        claim(scratch, second)
    assert owner(scratch) == str(first.resolve())
    claim(scratch, second, adopt=True)
    assert owner(scratch) == str(second.resolve())
    assert f"taken over from run {first} by run {second} (checkpoint.adopt)" in capsys.readouterr().out
    with pytest.raises(CheckpointDirTakenError):  # the first run is refused in turn
        claim(scratch, first)


def test_a_live_job_keeps_the_folder_even_from_an_adopter(tmp_path: Path) -> None:
    scratch = tmp_path / "ckpt"
    claim(scratch, tmp_path / "a")
    holder = os.open(scratch / CHECKPOINT_LOCK, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: what a live job's rank 0 holds
        with pytest.raises(RunFolderBusyError, match=rf"^checkpoint.dir {scratch} is in use by a live job"):
            claim(scratch, tmp_path / "b", adopt=True)
    finally:
        os.close(holder)
    assert owner(scratch) == str((tmp_path / "a").resolve())


def test_a_folder_from_before_records_is_adopted_and_one_moved_with_its_run_stays(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    fake_checkpoint(run / "checkpoints", "phase1-step0000002")  # written before this release: no record
    claim(run / "checkpoints", run)
    assert capsys.readouterr().out.strip() == (f"checkpoint.dir {run / 'checkpoints'}: no {OWNER} (written before "
                                               f"runs recorded their checkpoint folder): now run {run}'s")
    shutil.move(run, tmp_path / "renamed")  # the run folder moved, its checkpoints inside it
    claim(tmp_path / "renamed" / "checkpoints", tmp_path / "renamed")
    assert "it moved or was copied with its run folder" in capsys.readouterr().out
    (tmp_path / "renamed" / "checkpoints" / OWNER).write_text("{torn")
    with pytest.raises(CheckpointDirTakenError, match="is unreadable"):
        claim(tmp_path / "renamed" / "checkpoints", tmp_path / "renamed")
