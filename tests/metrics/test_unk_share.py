"""The [UNK]-share monitor (pretrain/metrics/unk_share.py): counted on the host copy of each micro-batch in every
layout (padded, packed, unpadded) the same, summed with the step's own counts in its one all-reduce, and seen by
the monitor through the step context's vocabulary. Its tag on a real step: tests/metrics/test_monitors.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pretrain.data.batches import Collator, RankBatches, open_phase_data
from pretrain.metrics.monitor_contract import StepContext
from pretrain.metrics.unk_share import REAL, UNK, UnkShare
from pretrain.step_stats import StepResult
from tests.support.pretrain_fixtures import build_shards
from tests.support.trainer_fixtures import build_trainer


def test_the_share_is_the_same_in_every_layout_and_counts_only_real_tokens(tmp_path: Path) -> None:
    shards = build_shards(tmp_path / "shards", seq_lens=(64,), train=16, val=4)
    data = open_phase_data(shards, 64, None, "data.shards")
    assert data.vocab.unk_id is not None
    rows = [RankBatches(data, "train", 1, 0, 1, 8).reader[i] for i in range(8)]
    planted = []
    for index, row in enumerate(rows):  # [UNK] at the 2nd and 3rd token of every other row (never a special)
        ids = row["input_ids"].copy()
        if index % 2 == 0:
            ids[1:3] = data.vocab.unk_id
        planted.append(dict(row, input_ids=ids))
    real = sum(len(r["input_ids"]) for r in planted)
    monitor, context = UnkShare(), StepContext(None, data.vocab)
    counted = {}
    for name, layout in (("padded", {}), ("packed", {"packing": True}), ("unpadded", {"unpadded": True})):
        batch = Collator(data, **layout)(planted, np.random.default_rng(0), 0.0001)  # almost no masks
        counted[name] = monitor.count(batch, context)
    assert all(c[REAL] == real for c in counted.values()), counted
    assert len({c[UNK] for c in counted.values()}) == 1 and counted["padded"][UNK] >= 7, counted
    result = StepResult(True, False, {}, None, counted=counted["padded"])  # type: ignore[arg-type]
    assert monitor.values(result) == {"data/unk_fraction": pytest.approx(counted["padded"][UNK] / real)}


def test_a_real_step_sums_the_monitors_counts_in_its_one_reduce(tmp_path: Path) -> None:
    """The step's result carries the [UNK] monitor's counts summed over its micro-batches: the real tokens equal
    the step's own count (StepCounts.real_tokens), which the same reduce carries."""
    trainer = build_trainer(tmp_path, ["--model.compile=false"], steps=2)
    result = trainer.train_step()
    assert result.counted[REAL] == result.counts.real_tokens > 0
    assert result.counted[UNK] == 0  # the tiny corpus has no word outside its vocab
    values = trainer.step_metrics(result)
    assert values["data/unk_fraction"] == 0.0
