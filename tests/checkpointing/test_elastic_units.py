"""In-process tests (no launcher) of what elastic resume rests on: the world-size-free data stream and
validation set, checkpoint manifests and the choice of the checkpoint to resume from, and the resume
checks that refuse what cannot continue exactly. The multi-rank behaviour is tests/checkpointing/test_elastic_multirank.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.checkpointing.checkpoint import CheckpointManager
from pretrain.checkpointing.elastic import prepare_resume
from pretrain.checkpointing.manifest import MANIFEST, damage, file_owner, own_entries, resolve_resume_tag
from pretrain.data.batches import RankBatches, ValidationBatches, open_phase_data
from pretrain.errors import ConfigError, ResumeError
from pretrain.model.bert import IGNORE_INDEX
from pretrain.trainer import PhaseState
from tests.support.pretrain_fixtures import build_shards

GLOBAL = 24  # with 64 instances an epoch ends inside a step: steps straddle epochs
SPLITS = [(1, 24), (1, 6), (2, 4), (3, 8), (4, 3)]  # (world size, micro batch): accumulation = 24 / (world x micro)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - PhaseData
    shards = build_shards(tmp_path_factory.mktemp("elastic_units") / "shards", train=64, val=16)
    return open_phase_data(shards, 32, None, "data.shards")


def rows_of(batch: dict[str, torch.Tensor]) -> list[tuple]:
    """One hashable row per instance: its tokens, masked positions, labels and NSP label."""
    return [(tuple(batch["input_ids"][i].tolist()), tuple(batch["masked_positions"][i].tolist()),
             tuple(batch["masked_labels"][i].tolist()), int(batch["next_sentence_label"][i]))
            for i in range(batch["input_ids"].size(0))]


def step_rows(data, world: int, micro: int, step: int) -> list[tuple]:  # noqa: ANN001
    accumulation = GLOBAL // (world * micro)
    out = []
    for rank in range(world):
        stream = RankBatches(data, "train", seed=5, rank=rank, world_size=world, micro_batch=micro)
        for k in range(step * accumulation, (step + 1) * accumulation):
            out.extend(rows_of(stream[k]))
    return sorted(out)


def test_every_split_of_the_global_batch_trains_on_the_same_instances_and_masks(data) -> None:  # noqa: ANN001
    for step in range(8):  # 8 x 24 samples: three epochs of 64, most steps crossing an epoch boundary
        reference = step_rows(data, *SPLITS[0], step)
        assert len(reference) == GLOBAL
        for world, micro in SPLITS[1:]:
            assert step_rows(data, world, micro, step) == reference, (step, world, micro)
    # the phase is part of every mask's seed; the instances stay the same
    phases = [RankBatches(data, "train", seed=5, rank=0, world_size=1, micro_batch=8, phase_index=i) for i in (0, 1)]
    assert phases[0].stream_instances(0, 8) == phases[1].stream_instances(0, 8)
    assert not torch.equal(phases[0][0]["masked_positions"], phases[1][0]["masked_positions"])


def test_an_instance_is_masked_by_its_epoch_not_by_its_position(data) -> None:  # noqa: ANN001
    stream = RankBatches(data, "train", seed=5, rank=0, world_size=1, micro_batch=8)
    instance = int(stream.rank_indices(0)[0])
    first = stream.collate_instances([(0, instance)])
    assert rows_of(first) == rows_of(stream.collate_instances([(0, instance)]))
    again = stream.collate_instances([(1, instance)])  # next epoch: new mask
    assert not torch.equal(first["masked_positions"], again["masked_positions"])
    # in a batch with other instances (any rank, any micro-batch) it carries the same mask
    mixed = stream.collate_instances([(0, int(stream.rank_indices(0)[5])), (0, instance)])
    assert rows_of(mixed)[1] == rows_of(first)[0]


@pytest.mark.parametrize("instances", [16, 11, 3])
def test_validation_reads_the_same_instances_on_any_world_size(data, instances: int) -> None:  # noqa: ANN001
    seen = {}
    for world, micro in ((1, 4), (2, 8), (3, 2), (4, 3)):
        rows, counts = [], set()
        for rank in range(world):
            val = RankBatches(data, "val", seed=5, rank=rank, world_size=world, micro_batch=micro, shuffle=False)
            batches = list(ValidationBatches(val, instances))
            counts.add(len(batches))
            for batch in batches:
                labelled = (batch["masked_labels"] != IGNORE_INDEX).any(dim=1)
                rows.extend(r for r, keep in zip(rows_of(batch), labelled.tolist(), strict=True) if keep)
        assert len(counts) == 1, (world, counts)  # the same number of forward passes on every rank (ZeRO-3)
        seen[world] = sorted(rows)
        assert len(rows) == min(instances, 16)
    assert all(rows == seen[1] for rows in seen.values())
    with_seed = RankBatches(data, "val", seed=6, rank=0, world_size=1, micro_batch=4, shuffle=False)
    assert sorted(r for b in ValidationBatches(with_seed, instances) for r in rows_of(b)) == seen[1]  # seed-free


def test_phase_states_without_a_data_order_are_the_old_kind() -> None:
    assert PhaseState.from_dict({"phase": "phase1", "step": 3, "data_position": 6}).data_order == 1
    assert PhaseState.from_dict(PhaseState("phase1").state_dict()).data_order == 2


# ---------------------------------------------------------------- manifests
def fake_checkpoint(root: Path, tag: str, ranks: int = 2) -> Path:
    folder = root / tag
    folder.mkdir(parents=True)
    for rank in range(ranks):
        (folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(bytes([rank]) * (1000 + rank))
        (folder / f"rng_rank{rank:05d}.pt").write_bytes(b"rng" * (rank + 1))
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"model" * 50)
    atomic_write_json(folder / "trainer_state.json", {"phase": "phase1", "step": int(tag[-7:]), "complete": False})
    files = {}
    for rank in range(ranks):
        files.update(own_entries(folder, rank))
    atomic_write_json(folder / MANIFEST, {"tag": tag, "world_size": ranks, "files": files})
    (root / "latest").write_text(tag)
    return folder


def test_each_file_is_hashed_by_the_rank_that_writes_it(tmp_path: Path) -> None:
    assert [file_owner(n) for n in ("zero_pp_rank_3_mp_rank_00_optim_states.pt",
                                    "bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt", "rng_rank00007.pt",
                                    "elastic_layout_rank00002.json", "mp_rank_00_model_states.pt",
                                    "zero_pp_rank_0_mp_rank_00_model_states.pt", "trainer_state.json")] == [
        3, 12, 7, 2, 0, 0, 0]
    folder = fake_checkpoint(tmp_path, "phase1-step0000004")
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert files["zero_pp_rank_1_mp_rank_00_optim_states.pt"] == {
        "size": 1001, "rank": 1, "sha256": files["zero_pp_rank_1_mp_rank_00_optim_states.pt"]["sha256"]}
    assert damage(folder) is None
    (folder / "rng_rank00001.pt").write_bytes(b"gnr" * 2)  # same size, other bytes
    assert damage(folder) == "rng_rank00001.pt differs from what was written (sha256)"


def test_resume_tag_falls_back_past_damaged_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root, keep_last=3, rank=0)
    assert resolve_resume_tag(manager.root, manager.rank) is None  # nothing yet: a fresh start
    for step in (2, 4, 6):
        fake_checkpoint(root, f"phase1-step{step:07d}")
    assert resolve_resume_tag(manager.root, manager.rank) == "phase1-step0000006"
    assert "verified against its manifest" in capsys.readouterr().out
    newest = root / "phase1-step0000006" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    newest.write_bytes(newest.read_bytes()[:10])
    (root / "phase1-step0000004" / "mp_rank_00_model_states.pt").unlink()
    assert resolve_resume_tag(manager.root, manager.rank) == "phase1-step0000002"
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"checkpoint {root / 'phase1-step0000006'} is damaged: zero_pp_rank_1_mp_rank_00_optim_states.pt has 10 bytes, "
        "1001 were written; moved to phase1-step0000006.damaged, resuming from phase1-step0000002",
        f"checkpoint {root / 'phase1-step0000004'} is damaged: mp_rank_00_model_states.pt is missing; moved to "
        "phase1-step0000004.damaged, resuming from phase1-step0000002",
    ]
    assert (root / "latest").read_text() == "phase1-step0000002"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "phase1-step0000002", "phase1-step0000004.damaged", "phase1-step0000006.damaged"]
    (root / "phase1-step0000002" / "rng_rank00000.pt").unlink()
    with pytest.raises(ResumeError, match=r"^checkpoint.dir: no intact checkpoint to resume from in .*"
                                          r"\(phase1-step0000002: rng_rank00000.pt is missing\)$"):
        resolve_resume_tag(manager.root, manager.rank)


# ---------------------------------------------------------------- resume checks
def saved_run(root: Path, world: int, global_batch: int, data_order: int | None = 2) -> str:
    tag = "phase1-step0000004"
    folder = root / tag
    folder.mkdir(parents=True)
    state = {"phase": "phase1", "step": 4, "data_position": 4 * global_batch, "complete": False}
    if data_order is not None:
        state["data_order"] = data_order
    atomic_write_json(folder / "trainer_state.json", state)
    atomic_write_json(folder / "run_config.json", {"resolved": {
        "world_size": world, "ds_configs": {"phase1": {"train_batch_size": global_batch}}}})
    return tag


def ds(global_batch: int, micro: int, accumulation: int) -> dict[str, dict[str, int]]:
    return {"phase1": {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
                       "gradient_accumulation_steps": accumulation}}


def test_resume_refuses_a_changed_global_batch_and_old_data_positions(tmp_path: Path) -> None:
    tag = saved_run(tmp_path / "a", world=2, global_batch=16)
    prepare_resume(tmp_path / "a", tag, ds(16, 8, 1), rank=0, world_size=2)  # same world, same batch: nothing to do
    with pytest.raises(ConfigError, match=r"^phase1.batch_size: .* global batch of 16 sequences, this job's is 32 "
                                          r"\(micro batch 4 x accumulation 2 x 4 ranks\); set "
                                          r"phase1.batch_size=16 with a phase1.micro_batch_size and no "
                                          r"phase1.gradient_accumulation_steps"):
        prepare_resume(tmp_path / "a", tag, ds(32, 4, 2), rank=0, world_size=4)
    old = saved_run(tmp_path / "b", world=2, global_batch=16, data_order=None)
    with pytest.raises(ResumeError, match="counts its data position in micro-batches of one rank"):
        prepare_resume(tmp_path / "b", old, ds(16, 8, 1), rank=0, world_size=2)
    # another world size, but the checkpoint does not record its layout: one line naming the file
    with pytest.raises(ResumeError, match=r"^checkpoint.dir: cannot resume .* on 4 ranks: .*"
                                          r"elastic_layout_rank00000.json is missing"):
        prepare_resume(tmp_path / "a", tag, ds(16, 4, 1), rank=0, world_size=4)


def test_stream_positions_can_be_produced_directly(data) -> None:  # noqa: ANN001
    """A resume starts the loader at any micro-batch: item k is a pure function of k (no iteration state)."""
    stream = RankBatches(data, "train", seed=5, rank=1, world_size=2, micro_batch=4)
    again = RankBatches(data, "train", seed=5, rank=1, world_size=2, micro_batch=4)
    for k in (11, 0, 7):
        assert rows_of(stream[k]) == rows_of(again[k])
    with pytest.raises(IndexError, match="not in rank 1's chunks"):
        stream.stream_instances(0, 1)
    assert np.array_equal(np.sort(stream.rank_indices(0)), np.sort(again.rank_indices(0)))
