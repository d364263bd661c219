"""The masking-rate schedule (pretrain/schedules/masking.py) as the model meets it: the rate measured on the
batches a real one-rank DeepSpeed engine was fed, step by step, against the schedule and the logged value; a
mid-schedule position read on another number of ranks; and the one-line refusals.

(Exact resume of a run with a moving masking rate, on 1, 2 and 4 ranks, is covered by the elastic launches of
tests/checkpointing/test_elastic_multirank.py, whose runs train with a linear 0.30 -> 0.15 schedule.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.data.batches import StreamPlan, phase_data
from pretrain.data.shard_checks import check_phase_shards
from pretrain.data.unpadded import real_tokens
from pretrain.errors import ConfigError
from pretrain.keys import SeedSection
from pretrain.model.bert import IGNORE_INDEX
from pretrain.schedules.clock import PhaseClock
from pretrain.schedules.masking import LinearRate, MaskingSettings, StepwiseRate, build_mask_schedule
from pretrain.schedules.phase import PhaseSchedules
from tests.support.pretrain_fixtures import build_shards
from tests.support.trainer_fixtures import build_trainer

LINEAR = ["--data.mask_probability=0.3", "--phase1.masking_schedule=linear", "--phase1.mask_rate_end=0.15"]


class BatchRecorder:
    """Passes every forward through to the engine and keeps the batch it was given (what the model saw)."""

    def __init__(self, engine: Any) -> None:
        self._engine, self.seen = engine, []

    def __call__(self, **batch: Any) -> Any:
        self.seen.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        return self._engine(**batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def masked_share(batches: list[dict[str, Any]]) -> float:
    """Labelled MLM slots over real tokens ([CLS] and [SEP] included, as the masker counts an instance)."""
    labelled = sum(int((b["masked_labels"] != IGNORE_INDEX).sum()) for b in batches)
    return labelled / sum(real_tokens_seen(b) for b in batches)


def real_tokens_seen(batch: dict[str, Any]) -> int:
    """Real tokens of a batch as the engine got it: unpadded (flat, a bucket tail after the last instance), padded
    with its mask, or padded without one (no row had padding: model_inputs drops an all-ones mask)."""
    if "cu_seqlens" in batch:
        return real_tokens(batch)
    mask = batch.get("attention_mask")
    return int(batch["input_ids"].numel()) if mask is None else int(mask.sum())


def test_the_rate_the_model_saw_follows_the_schedule_and_is_logged_every_step(tmp_path: Path) -> None:
    """Linear 0.30 -> 0.15 over 6 steps of 16 sequences (micro-batch 8 x accumulation 2): each step's batches, as the engine received them, are
    masked within 0.01 of the schedule, and the step logs the schedule's value (schedule/mask_rate, in the values
    TensorBoard and metrics.jsonl are written from); the last step reaches the end rate."""
    steps = 6
    trainer = build_trainer(tmp_path, [*LINEAR, "--phase1.micro_batch_size=8"], steps=steps)
    recorder = BatchRecorder(trainer.engine)
    trainer.engine = recorder
    expected = LinearRate(0.3, 0.15)
    for step in range(steps):
        values = trainer.step_metrics(trainer.train_step())
        trainer.state.step += 1
        seen, recorder.seen = recorder.seen, []
        assert len(seen) == trainer.accumulation
        scheduled = expected.start + (expected.end - expected.start) * step / (steps - 1)
        assert values["schedule/mask_rate"] == pytest.approx(scheduled, abs=1e-12), step
        assert masked_share(seen) == pytest.approx(scheduled, abs=0.01), (step, masked_share(seen), scheduled)
    assert scheduled == pytest.approx(0.15)
    # named where the report's and the model card's recipe tables read a phase's schedules
    recorded = trainer.resolved_config["resolved"]["schedules"]["phase1"]
    assert recorded.endswith("; masking rate linear from 0.3 at the first step to 0.15 at the last"), recorded
    assert trainer.resolved_config["resolved"]["phase_schedules"]["phase1"] == {
        "masking": "linear from 0.3 at the first step to 0.15 at the last"}
    assert trainer.settings.schedules is not None and trainer.train_batches.schedules is trainer.settings.schedules


def test_a_step_is_masked_alike_on_any_number_of_ranks(tmp_path: Path) -> None:
    """Mid-schedule (step 5 of 8), the step's instances and their masks are the same whether 1 rank reads them as
    4 micro-batches or 2 ranks as 2 each: the rate depends on the step alone, so a run resumed there on another
    number of ranks masks each step as the uninterrupted run did."""
    shards = build_shards(tmp_path / "shards")
    data = phase_data(check_phase_shards(shards, 64, None, "data.shards", mask_probability=0.3), 64)
    schedule = build_mask_schedule(MaskingSettings("linear", 0.15), 0.3, static=False)
    schedules = PhaseSchedules(PhaseClock(phase_steps=8, global_batch=16, seq_len=64), schedule)
    stream = StreamPlan(SeedSection(3), schedules=schedules)

    def step_rows(world: int, step: int) -> dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]]:
        """(epoch, instance) -> (its real ids as masked, its labels), over the step's micro-batches on every rank."""
        micro = 4  # 1 rank: 4 micro-batches of 4; 2 ranks: 2 each
        rows = {}
        for rank in range(world):
            batches = stream.batches(data, "train", rank, world, micro)
            per_step = 16 // (micro * world)
            for k in range(step * per_step, (step + 1) * per_step):
                batch = batches[k]
                first = (k * world + rank) * micro
                for i, picked in enumerate(batches.stream_instances(first, micro)):
                    real = batch["attention_mask"][i].bool()
                    rows[picked] = (tuple(batch["input_ids"][i][real].tolist()),
                                    tuple(batch["masked_labels"][i].tolist()))
        return rows

    one, two = step_rows(1, 5), step_rows(2, 5)
    assert len(one) == 16 and one == two
    masked = sum(sum(label != IGNORE_INDEX for label in labels) for _, labels in one.values())
    assert masked / sum(len(ids) for ids, _ in one.values()) == pytest.approx(schedule.rate(schedules.clock.at_step(5)), abs=0.01)


def test_a_moving_rate_is_refused_in_one_line_where_it_cannot_hold(tmp_path: Path) -> None:
    """Static shards hold masks made at one rate; a bad end rate or stair count; an unknown schedule: each one
    ConfigError naming the key, before any engine exists (the plan builds the schedule)."""
    with pytest.raises(ConfigError, match=r"^phase1\.masking_schedule: linear needs dynamic shards"):
        build_mask_schedule(MaskingSettings("linear", 0.15), 0.3, static=True, where="phase1.")
    with pytest.raises(ConfigError, match=r"^phase2\.mask_rate_end: must be in \(0, 1\) for masking_schedule linear, "
                                          r"got None$"):
        build_mask_schedule(MaskingSettings("linear"), 0.3, static=False, where="phase2.")
    with pytest.raises(ConfigError, match=r"^phase1\.mask_rate_stairs: must be >= 2, got 1$"):
        build_mask_schedule(MaskingSettings("stepwise", 0.15, 1), 0.3, static=False, where="phase1.")
    with pytest.raises(ConfigError, match=r"^phase1\.masking_schedule: 'cosine' is not one of constant, linear, "):
        build_mask_schedule(MaskingSettings("cosine", 0.15), 0.3, static=False, where="phase1.")
    assert build_mask_schedule(MaskingSettings(), 0.3, static=True).describe() == "0.3 throughout"
    stairs = StepwiseRate(0.3, 0.15, 4)
    clock = PhaseClock(phase_steps=8, global_batch=4, seq_len=16)
    assert [round(stairs.rate(clock.at_step(s)), 6) for s in range(8)] == [0.3, 0.3, 0.25, 0.25, 0.2, 0.2, 0.15, 0.15]
    static = shutil.copytree(build_shards(tmp_path / "shards"), tmp_path / "static")
    manifest = json.loads((static / "manifest.json").read_text())
    manifest["masking"]["mode"] = "static"
    (static / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"^phase1\.masking_schedule: linear needs dynamic shards"):
        build_trainer(tmp_path / "run", LINEAR[1:], shards=static)
