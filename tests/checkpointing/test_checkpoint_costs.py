"""What a save costs the ranks that did not write a file: no metadata operations on other ranks' files while
the manifest is built, and no wait for rank 0's deletion of old tags (renamed aside before the final
barrier, deleted after it; a half-deleted one is never a resume candidate)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.checkpointing.checkpoint import PRUNED_PREFIX, CheckpointManager
from pretrain.checkpointing.manifest import MANIFEST, file_owner, own_entries, resolve_resume_tag

RANKS = 4


def rank_files(rank: int) -> list[str]:
    return [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            f"rng_rank{rank:05d}.pt", f"elastic_layout_rank{rank:05d}.json"]


def fake_tag(root: Path, tag: str) -> Path:
    """A tag folder as RANKS ranks leave it (the bytes do not matter here), with its manifest."""
    folder = root / tag
    (folder / "extra").mkdir(parents=True)
    for rank in range(RANKS):
        for name in rank_files(rank):
            (folder / name).write_bytes(name.encode() * (rank + 1))
    (folder / "extra" / "rng_rank00002.pt").write_bytes(b"nested")  # a subfolder is still walked
    for name in ("mp_rank_00_model_states.pt", "trainer_state.json", ".trainer_state.json.tmp"):
        (folder / name).write_bytes(b"rank zero")
    files = {}
    for rank in range(RANKS):
        files.update(own_entries(folder, rank))
    atomic_write_json(folder / MANIFEST, {"tag": tag, "world_size": RANKS, "files": files})
    return folder


def test_a_rank_stats_only_the_files_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = fake_tag(tmp_path, "phase1-step0000004")
    statted: list[Path] = []
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:  # pass-through spy
        statted.append(Path(os.fsdecode(path)))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting_stat)  # pathlib's stat/is_file/exists and os.path go through it
    listed: dict[str, int] = {}
    for rank in range(RANKS):
        statted.clear()
        entries = own_entries(folder, rank)
        others = [p.relative_to(folder).as_posix() for p in statted
                  if p.is_relative_to(folder) and file_owner(p.name) != rank]
        assert others == [], (rank, others)
        assert sorted(p.relative_to(folder).as_posix() for p in statted) == sorted(entries)  # the spy sees
        listed.update({rel: entry["rank"] for rel, entry in entries.items()})
    monkeypatch.undo()
    expected = {p.relative_to(folder).as_posix() for p in folder.rglob("*")
                if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST}
    assert set(listed) == expected  # every file once, by its writer (same manifest as before)
    assert listed["extra/rng_rank00002.pt"] == 2 and listed["trainer_state.json"] == 0


def test_a_half_deleted_old_tag_is_never_resumed_and_is_deleted_later(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_tag(root, f"phase1-step{step:07d}")
    (root / "latest").write_text("phase1-step0000006")
    manager = CheckpointManager(root, keep_last=2, rank=0)
    aside = manager.set_aside_old_tags(keep="phase1-step0000006")
    assert [p.name for p in aside] == [f"{PRUNED_PREFIX}phase1-step0000002-0"]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "latest", "phase1-step0000004", "phase1-step0000006"]  # keep_last tags, before any deletion
    (aside[0] / MANIFEST).unlink()  # what a crash in the middle of the deletion can leave
    (aside[0] / "rng_rank00001.pt").unlink()
    newest = root / "phase1-step0000006" / "rng_rank00003.pt"
    newest.write_bytes(b"torn")
    assert resolve_resume_tag(manager.root, manager.rank) == "phase1-step0000004"  # the intact one, not the manifest-less leftover
    assert manager.set_aside_old_tags(keep="phase1-step0000004") == aside  # the next save finds the leftover
    manager.delete_set_aside(aside)
    assert not aside[0].exists()


def folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_rank_zero_deletes_old_tags_after_the_final_barrier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real DeepSpeed engine (world of one, gloo) saving five tags with keep_last=2; a pass-through spy
    records the barriers and deletions of each save in order."""
    from pretrain.engine import build_engine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11))
    engine = build_engine(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                  "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    events: list[str] = []
    real_barrier, real_rmtree = dist.barrier, shutil.rmtree

    def barrier(*args: Any, **kwargs: Any) -> Any:
        events.append("barrier")
        return real_barrier(*args, **kwargs)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        events.append(f"rmtree {Path(path).name} while {folders(root)}")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root, keep_last=2, rank=0)
    run_config = {"resolved": {"world_size": 1}}
    for step in range(1, 6):
        events.clear()
        manager.save(engine, f"phase1-step{step:07d}", {"step": step}, run_config, phase_end=step == 1)
        kept = sorted({"phase1-step0000001", *(f"phase1-step{s:07d}" for s in (step - 1, step) if s)})
        assert folders(root) == kept
        if step >= 4:  # step 1 is a phase end (kept); from step 4 on one older step tag goes, after the barrier
            aside = f"{PRUNED_PREFIX}phase1-step{step - 2:07d}-0"
            assert events[-2:] == ["barrier", f"rmtree {aside} while {sorted([aside, *kept])}"]
        else:
            assert not any(event.startswith("rmtree") for event in events)
