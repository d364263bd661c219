"""What the shards decide and what a run may ask of them: one objective per run (MLM + NSP on sentence pairs,
MLM alone on packed sentences), the masking rate of dynamic shards, and BERT's 80/10/10 split at any rate.
All on the host: shard folders, the launch-time check's shard loop and the collator, no ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_prep.shard_format.shards import Manifest
from pretrain.config.load import load_config
from pretrain.data.batches import StreamPlan, phase_data
from pretrain.data.shard_checks import check_phase_shards, masking_rate
from pretrain.errors import ConfigError
from pretrain.keys import SeedSection
from pretrain.model.bert import IGNORE_INDEX
from pretrain.plan.shard_plan import check_run_shards
from tests.support.pretrain_fixtures import build_shards, tiny_run_config


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("objective")
    return {"nsp": build_shards(root / "pairs"),
            "full-sentences": build_shards(root / "packed", seq_lens=(32, 64), train=1600, val=400,
                                           segments="full-sentences")}


def config_for(tmp_path: Path, phase1: Path, phase2: Path, *overrides: str):
    run_json = tiny_run_config(tmp_path / "run.json", phase1, tmp_path / "run")
    return load_config(str(run_json), [f"--phase2.shards={phase2}", *overrides])


def test_one_run_trains_one_objective_and_can_insist_on_it(folders: dict[str, Path], tmp_path: Path) -> None:
    pairs, packed = folders["nsp"], folders["full-sentences"]
    assert check_run_shards(config_for(tmp_path, packed, packed))["phase1"].trains_nsp is False
    assert check_run_shards(config_for(tmp_path, pairs, pairs))["phase1"].trains_nsp is True
    with pytest.raises(ConfigError) as mixed:
        check_run_shards(config_for(tmp_path, pairs, packed))
    line = str(mixed.value)
    assert line.startswith(f"phase2.shards: {packed} was built with --segments full-sentences, data.shards")
    assert "with --segments nsp: one run trains one objective" in line and "\n" not in line
    with pytest.raises(ConfigError, match=r"^data.objective: mlm, but data.shards .* was built with --segments nsp, "
                                          r"which trains MLM \+ NSP; build the shards with --segments full-sentences"):
        check_run_shards(config_for(tmp_path, pairs, pairs, "--data.objective=mlm"))
    with pytest.raises(ConfigError, match=r"^data.objective: 'mlm-only' is not one of mlm, mlm\+nsp"):
        config_for(tmp_path, pairs, pairs, "--data.objective=mlm-only")


def test_static_masks_keep_their_rate_and_dynamic_ones_take_the_runs(folders: dict[str, Path], tmp_path: Path) -> None:
    static = tmp_path / "static"
    static.mkdir()
    manifest = json.loads((folders["nsp"] / "manifest.json").read_text())
    manifest["masking"]["mode"] = "static"
    (static / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"^data.mask_probability: 0.3, but data.shards .* holds static masks made "
                                          r"at 0.15 \(data_prep --mask-prob\); rebuild them"):
        masking_rate(Manifest.load(static), 0.3, "data.shards")
    assert masking_rate(Manifest.load(static), 0.15, "data.shards") == 0.15
    dynamic = Manifest.load(folders["nsp"])
    assert masking_rate(dynamic, None, "data.shards") == 0.15 and masking_rate(dynamic, 0.3, "data.shards") == 0.3
    # the prediction slots grow with the rate: data_prep's rule, 20 per 128 tokens at 15 %
    assert check_phase_shards(dynamic, 64, None, "data.shards", mask_probability=0.3).max_predictions == 20
    assert check_phase_shards(dynamic, 64, None, "data.shards").max_predictions == 10  # the manifest's


def masked_shares(folder: Path, rate: float | None, split: str) -> tuple[float, float, float, float, int]:
    """(masked share of the tokens, [MASK] share, unchanged share, random share of the masked ones, masked count)
    over every micro-batch of one epoch of `split`, as the training (or validation) stream masks them."""
    checked = check_phase_shards(folder, 64, None, "data.shards", mask_probability=rate)
    data = phase_data(checked, 64)
    batches = StreamPlan(SeedSection(5)).batches(data, split, rank=0, world_size=1, micro_batch=16)
    tokens = masked = as_mask = unchanged = 0
    for k in range(len(batches)):
        batch = batches[k]
        labels, positions = batch["masked_labels"].numpy(), batch["masked_positions"].numpy()
        ids = batch["input_ids"].numpy()
        tokens += int(batch["attention_mask"].sum())
        rows, slots = np.nonzero(labels != IGNORE_INDEX)
        shown = ids[rows, positions[rows, slots]]
        masked += len(rows)
        as_mask += int((shown == data.vocab.mask_id).sum())
        unchanged += int((shown == labels[rows, slots]).sum())
    random = masked - as_mask - unchanged
    return masked / tokens, as_mask / masked, unchanged / masked, random / masked, masked


def test_dynamic_masking_takes_the_runs_rate_with_the_80_10_10_split(folders: dict[str, Path]) -> None:
    """1,600 packed instances at seq 64 (~77k tokens): 30 % of the tokens masked (as data_prep counts: specials in
    the total), 80 % of those shown as [MASK], 10 % a random token, 10 % unchanged; validation keeps BERT's 15 %."""
    share, as_mask, unchanged, random, masked = masked_shares(folders["full-sentences"], 0.3, "train")
    assert masked > 20_000
    assert share == pytest.approx(0.30, abs=0.005)
    assert as_mask == pytest.approx(0.8, abs=0.01)
    assert unchanged == pytest.approx(0.1, abs=0.01)  # a random draw of the original token counts here too
    assert random == pytest.approx(0.1, abs=0.01)
    val_share, *_ = masked_shares(folders["full-sentences"], 0.3, "val")
    assert val_share == pytest.approx(0.15, abs=0.01)
