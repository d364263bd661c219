"""Fast in-process tests of the pretraining driver's parts: config, schedule, data order, masking, shipped recipes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.shard_format.masking import mask_ids
from pretrain.config.deepspeed import resolve_batch, resolve_precision
from pretrain.config.load import RunConfig, load_config
from pretrain.data.batches import (
    DataConfigError,
    RankBatches,
    Vocab,
    open_phase_data,
)
from pretrain.data.order import LEGACY_ORDER, epoch_keys, feistel_permute, partition_indices
from pretrain.errors import ConfigError
from pretrain.schedules.lr import WarmupPolyDecay
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, tiny_run_config


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tmp_path_factory.mktemp("shards") / "data", train=64, val=16)


@pytest.fixture
def run_json(tmp_path: Path, shards: Path) -> Path:
    return tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")


# ---------------------------------------------------------------- config
def test_config_file_then_overrides(run_json: Path) -> None:
    config = load_config(run_json, ["--phase1.steps=11", "--model.overrides.hidden_dropout_prob=0.0",
                                    "--phase2.ds_overrides.zero_optimization.stage=1", "--run.dir=elsewhere"])
    assert config.phase1.steps == 11 and config.phase2.steps == 4
    assert config.model.overrides == {"hidden_dropout_prob": 0.0}
    assert config.phase2.ds_overrides == {"zero_optimization": {"stage": 1}}
    assert config.run.dir == "elsewhere" and config.phase2.seq_len == 64
    assert isinstance(config.phase1.lr, float)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("--phase1.stepz=3", "phase1.stepz: unknown key"),
        ("--trainer.steps=3", "trainer: unknown section"),
        ("--phase1.steps=many", "phase1.steps: expected int"),
        ("--phase1.steps=0", "phase1.steps: must be > 0"),
        ("--phase2.warmup_fraction=1.5", "phase2.warmup_fraction: must be in [0, 1), got 1.5"),
        ("--phase1.decay_power=-1", "phase1.decay_power: must be > 0, got -1"),
        ("--run.precision=fp8", "run.precision"),
        ("--run.phases=[\"phase2\",\"phase1\"]", "run.phases"),
        ("--run.phases=[\"phase3\"]", "run.phases: unknown phase 'phase3'"),
        ("--checkpoint.keep_last=0", "checkpoint.keep_last"),
        ("--phase1.ds_config=/nope.json", "phase1.ds_config: /nope.json does not exist"),
        ("--data.shards=\"\"", "data.shards: required"),
        ("--data.num_parts=0", "data.num_parts: must be >= 1"),
        ("--data.part=2", "data.part: must be in [0, data.num_parts=1)"),
        ("--run.dist_timeout_minutes=0", "run.dist_timeout_minutes: must be >= 1, got 0"),
        ("--run.dist_timeout_minutes=1.5", "run.dist_timeout_minutes: expected int"),
        ("phase1.steps=3", "expected --section.key=value"),
        ("--model.attention=flash", "model.attention: 'flash' is not one of auto, unpadded, padded"),
        ("--model.compile=yes", "model.compile: expected bool"),
        ("--model.attention=padded --model.compile=true", "model.compile: compiles the unpadded encoder layers"),
    ],
)
def test_bad_config_names_the_key(run_json: Path, override: str, names: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        load_config(run_json, override.split(" "))
    assert names in str(err.value)


def test_main_reports_config_errors_before_any_process_group(run_json: Path, capsys: pytest.CaptureFixture) -> None:
    from pretrain.train import main

    assert main(["--config", str(run_json), "--logging.tensorbord=false"]) == 2
    assert "logging.tensorbord: unknown key" in capsys.readouterr().err
    assert main(["--config", str(run_json.with_name("absent.json"))]) == 2


BATCH_NAMES = ("x.batch_size", "x.micro_batch_size", "x.gradient_accumulation_steps")


@pytest.mark.parametrize(
    ("batch", "dp", "expected"),
    [  # (batch_size, micro_batch_size, gradient_accumulation_steps); None: derived
        ((64, 4, None), 2, (64, 4, 8)),
        ((64, None, 4), 2, (64, 8, 4)),
        ((None, 4, 3), 2, (24, 4, 3)),
        ((24, 4, 3), 2, (24, 4, 3)),
        ((65536, 64, None), 256, (65536, 64, 4)),
    ],
)
def test_batch_arithmetic_derives_the_missing_value(batch: tuple, dp: int, expected: tuple) -> None:
    out = resolve_batch(*batch, dp, BATCH_NAMES)
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == expected


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ((25, 4, 3), "x.batch_size: 25 != x.micro_batch_size 4"),
        ((66, 4, None), "x.batch_size: 66 is not divisible"),
        ((64, None, None), "set at least two of"),
        ((64, 0, None), "x.micro_batch_size"),
    ],
)
def test_batch_arithmetic_errors_name_the_key(batch: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_batch(*batch, 2, BATCH_NAMES)


def test_precision_bf16_or_fp16_on_gpu_fp32_on_cpu() -> None:
    ds = {"bf16": {"immediate_grad_update": True}}  # the JSON's other bf16 keys stay; run.precision chooses
    assert resolve_precision(ds, "auto", "cpu", False)["bf16"]["enabled"] is False
    assert resolve_precision(ds, "auto", "cuda", True)["bf16"] == {"immediate_grad_update": True, "enabled": True}
    fp16 = resolve_precision({}, "auto", "cuda", False)["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0  # dynamic loss scaling


def test_plan_errors_name_the_key(tmp_path: Path, run_json: Path, shards: Path) -> None:
    from pretrain.distributed.info import DistInfo
    from pretrain.plan.run_plan import plan_run

    two_ranks = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    ok = plan_run(load_config(run_json), two_ranks, verify_checksums=True)
    assert ok.ds_configs["phase1"]["gradient_accumulation_steps"] == 2
    assert ok.resolved["resolved"]["model_config"]["vocab_size"] == 48
    other = build_shards(tmp_path / "other", seq_lens=(64,), train=8, val=4)
    (other / "vocab.txt").write_text((other / "vocab.txt").read_text() + "extra\n")
    cases = [
        (["--data.shards=" + str(tmp_path / "missing")], "data.shards: "),
        (["--phase2.seq_len=128"], "data.shards: " + str(shards) + " has no shards at sequence length 128"),
        (["--phase2.shards=" + str(other)], "phase2.shards: "),
        (["--model.overrides.vocab_size=100"], "model.overrides.vocab_size"),
        (["--model.overrides.hidden_sise=3"], "model.overrides.hidden_sise: not a BertConfig field"),
        (["--phase1.batch_size=18"], "phase1.batch_size: 18 != phase1.micro_batch_size 4"),
        (["--phase1.lr=null"], "phase1.lr: required"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError) as err:
            plan_run(load_config(run_json, overrides), two_ranks, verify_checksums=True)
        assert message in str(err.value), (overrides, str(err.value))
    # a corrupted shard is caught by its checksum before training
    shard = shards / "seq32" / "train-00000.arrow"
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(ValueError, match="sha256 differs"):
            plan_run(load_config(run_json), two_ranks, verify_checksums=True)
    finally:
        shard.write_bytes(original)


def manifest_reads(work: Callable[[], object]) -> int:
    """How many times `work` opens a shard folder's manifest.json (a real open, seen by an audit hook)."""
    opened: list[str] = []
    active = [True]

    def hook(event: str, args: tuple) -> None:
        if active and event == "open" and isinstance(args[0], (str, Path)) and str(args[0]).endswith("manifest.json"):
            opened.append(str(args[0]))

    sys.addaudithook(hook)  # a hook cannot be removed: `active` turns it off
    try:
        work()
    finally:
        active.clear()
    return len(opened)


def test_each_rank_reads_each_shard_folder_once(run_json: Path) -> None:
    """Rank 0 plans once (with checksums) and keeps that plan; another rank plans once after the verdict.
    Both phases read one folder here: before, rank 0 opened its manifest 8 times and the others 4."""
    from pretrain.distributed.info import DistInfo
    from pretrain.distributed.lifetime import release_run_folder
    from pretrain.plan.run_plan import plan_on_rank0

    config = load_config(run_json)
    ranks = [DistInfo(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu")) for rank in (0, 1)]
    try:
        assert manifest_reads(lambda: plan_on_rank0(config, ranks[0])) == 1
    finally:
        release_run_folder(Path(config.run.dir))
    assert manifest_reads(lambda: plan_on_rank0(config, ranks[1])) == 1
    two_folders = load_config(run_json, [f"--phase2.shards={config.data.shards}/."])
    assert manifest_reads(lambda: plan_on_rank0(two_folders, ranks[1])) == 1  # the same folder, spelled twice


# ---------------------------------------------------------------- schedule
def test_warmup_then_poly_decay() -> None:
    schedule = WarmupPolyDecay(steps=100, warmup_fraction=0.1, decay_power=0.5)
    assert schedule.warmup_steps == 10
    assert schedule(0) == pytest.approx(0.1) and schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(55) == pytest.approx(0.5**0.5)
    assert schedule(100) == 0.0 and schedule(500) == 0.0
    linear = WarmupPolyDecay(steps=100, warmup_fraction=0.0, decay_power=1.0)
    assert linear(0) == 1.0 and linear(50) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="warmup_fraction"):
        WarmupPolyDecay(10, 1.0)


# ---------------------------------------------------------------- data
def test_rank_streams_are_disjoint_deterministic_and_reshuffled(shards: Path) -> None:
    data = open_phase_data(shards, 32, None, "data.shards")
    ranks = [RankBatches(data, "train", seed=3, rank=r, world_size=2, micro_batch=4) for r in range(2)]
    assert len(ranks[0]) == 64 // 2 // 4
    epoch0 = [set(b.rank_indices(0).tolist()) for b in ranks]
    assert not epoch0[0] & epoch0[1] and len(epoch0[0] | epoch0[1]) == 64
    assert not np.array_equal(ranks[0].rank_indices(0), ranks[0].rank_indices(1))
    # the cached order is this rank's own copy: a view would keep the whole epoch permutation alive in workers
    for stream in ranks:
        own = stream.rank_indices(0)
        assert own.base is None and own.flags.owndata and own.size == 64 // 2
    again = RankBatches(data, "train", seed=3, rank=0, world_size=2, micro_batch=4)
    for k in (0, 5, 9):  # k=9: second epoch; any position can be produced directly (resume)
        a, b = ranks[0][k], again[k]
        assert all(torch.equal(a[key], b[key]) for key in a)
    other_seed = RankBatches(data, "train", seed=4, rank=0, world_size=2, micro_batch=4)
    assert not torch.equal(ranks[0][0]["input_ids"], other_seed[0]["input_ids"])


def test_data_parts_are_disjoint_fixed_across_seeds_and_cover_everything(shards: Path) -> None:
    data = open_phase_data(shards, 32, None, "data.shards")
    whole = RankBatches(data, "train", seed=3, rank=0, world_size=1, micro_batch=4)
    # one part is the whole set in the seed's own order: the stream of a run without parts is unchanged
    assert np.array_equal(whole.rank_indices(2), feistel_permute(np.arange(64), 64, epoch_keys(3, 2)))
    legacy = RankBatches(data, "train", seed=3, rank=0, world_size=1, micro_batch=4, order=LEGACY_ORDER)
    assert np.array_equal(legacy.rank_indices(2), np.random.default_rng([3, 2]).permutation(64))
    for num_parts, order in ((2, None), (3, None), (2, LEGACY_ORDER), (3, LEGACY_ORDER)):
        named = {} if order is None else {"order": order}
        parts = [partition_indices(64, p, num_parts, **named) for p in range(num_parts)]
        assert sorted(np.concatenate(parts).tolist()) == list(range(64))
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
        # two groups with different seeds read their own part, every epoch, whatever the seed
        for part, seed in ((0, 3), (num_parts - 1, 8)):
            stream = RankBatches(data, "train", seed=seed, rank=0, world_size=1, micro_batch=4, part=part,
                                 num_parts=num_parts, **named)
            assert len(stream) == len(parts[part]) // 4
            for epoch in (0, 1):
                assert set(stream.rank_indices(epoch).tolist()) <= set(parts[part].tolist())
    assert not set(partition_indices(64, 0, 2).tolist()) & set(partition_indices(64, 1, 2).tolist())
    # the legacy deal is numpy's, as runs written before the named orders dealt it
    deal = np.random.default_rng([0xD15_70177, 64, 3]).permutation(64)
    assert np.array_equal(partition_indices(64, 1, 3, LEGACY_ORDER), np.sort(deal[1::3]))
    with pytest.raises(DataConfigError, match="data.part 1 of 40"):
        RankBatches(data, "train", seed=3, rank=0, world_size=1, micro_batch=4, part=1, num_parts=40)
    with pytest.raises(ValueError, match="data.part"):
        partition_indices(64, 2, 2)


def test_collate_masks_dynamically_and_pads(shards: Path) -> None:
    data = open_phase_data(shards, 32, None, "data.shards")
    batches = RankBatches(data, "train", seed=3, rank=0, world_size=1, micro_batch=8)
    batch = batches[0]
    assert batch["input_ids"].shape == (8, 32) and batch["masked_positions"].shape == (8, data.max_predictions)
    rows = [batches.reader[int(i)] for i in batches.rank_indices(0)[:8]]
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["attention_mask"][i].sum() == n and batch["token_type_ids"][i, row["a_len"]] == 1
        valid = batch["masked_labels"][i] != -100
        positions = batch["masked_positions"][i][valid]
        assert torch.equal(batch["masked_labels"][i][valid], torch.as_tensor(row["input_ids"])[positions])
        assert 1 <= int(valid.sum()) <= data.max_predictions
        assert not set(row["input_ids"][positions.numpy()].tolist()) & {data.vocab.cls_id, data.vocab.sep_id}
    # the same instances in another epoch (or on another rank) get other masks
    again = batches.collate(rows, np.random.default_rng([3, 1, 0, 0]))
    assert not torch.equal(batch["masked_positions"], again["masked_positions"])


def test_mask_instance_statistics_and_whole_words(shards: Path) -> None:
    vocab = Vocab.load(shards / "vocab.txt")
    rng = np.random.default_rng(0)
    ids = np.array([2] + list(range(5, 45)) * 5 + [3])
    masked_count = kept_count = 0
    for _ in range(200):
        masked, positions, labels = mask_ids(ids, vocab, 0.15, 40, False, rng)
        assert len(positions) == 30 and np.array_equal(labels, ids[positions])  # round(202 * 0.15) = 30
        masked_count += int((masked[positions] == vocab.mask_id).sum())
        kept_count += int((masked[positions] == labels).sum())  # 10% kept, plus random picks of the same id
    assert 0.75 < masked_count / 6000 < 0.85 and 0.08 < kept_count / 6000 < 0.14
    # whole words: "w5 ##a ##b" is masked entirely or not at all
    word = np.array([2, 5, 45, 46, 6, 7, 8, 9, 10, 11, 12, 13, 3])
    for seed in range(30):
        _, positions, _ = mask_ids(word, vocab, 0.4, 5, True, np.random.default_rng(seed))
        chosen = set(positions.tolist())
        assert chosen.isdisjoint({1, 2, 3}) or {1, 2, 3} <= chosen


# ---------------------------------------------------------------- model
def test_run_config_round_trips_through_json(run_json: Path) -> None:
    config = load_config(run_json)
    again = load_config(None, [f"--{section}.{key}={json.dumps(value)}"
                               for section, body in config.to_dict().items()
                               for key, value in body.items()])
    assert again.to_dict() == config.to_dict()
    assert isinstance(RunConfig().phase2.seq_len, int)


@pytest.mark.parametrize("run_file", sorted((REPO_ROOT / "ds_configs" / "recipes").glob("*.json")))
def test_shipped_run_configs_resolve_for_8_gpus(run_file: Path) -> None:
    from pretrain.config.deepspeed import phase_ds_config

    config = load_config(run_file)
    for name in config.run.phases:
        ds = phase_ds_config(config, name, dp_size=8, device_type="cuda", bf16_supported=True)
        micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        assert micro * accum * 8 == ds["train_batch_size"]
        # LAMB, except where the recipe follows a published AdamW run (its `about` names it)
        assert ds["optimizer"]["type"] == ("AdamW" if "budget" in run_file.name else "ExactLamb")
        assert ds["bf16"]["enabled"] or "tiny" in run_file.name
        cpu = phase_ds_config(config, name, dp_size=2, device_type="cpu")
        assert not cpu["bf16"]["enabled"] and not cpu["fp16"]["enabled"]


def test_codistillation_recipe_is_two_32k_bert_large_groups_on_disjoint_halves() -> None:
    config = load_config(REPO_ROOT / "ds_configs" / "recipes" / "bert_large_codistill.json")
    section = config.plugins["codistill"]
    assert section.enabled and section.groups == 2 and section.disjoint_data and section.group is None
    assert 0 < section.burn_in_steps < config.phase1.steps and section.exchange == "collective"
    # as separate jobs, one per allocation: the same file plus two overrides
    job = load_config(REPO_ROOT / "ds_configs" / "recipes" / "bert_large_codistill.json",
                      ["--codistill.group=1", "--codistill.exchange=\"filesystem\""])
    assert (job.plugins["codistill"].group, job.plugins["codistill"].exchange) == (1, "filesystem")


def test_recipe_numbers_of_bert_large_64k() -> None:
    from pretrain.config.deepspeed import phase_ds_config

    config = load_config(REPO_ROOT / "ds_configs" / "recipes" / "bert_large_64k.json")
    p1 = phase_ds_config(config, "phase1", 8, "cuda", True)
    p2 = phase_ds_config(config, "phase2", 8, "cuda", True)
    assert (p1["train_batch_size"], p1["optimizer"]["params"]["lr"], config.phase1.steps) == (65536, 6e-3, 7038)
    assert (p2["train_batch_size"], p2["optimizer"]["params"]["lr"], config.phase2.steps) == (32768, 4e-3, 1563)
    assert (config.phase1.warmup_fraction, config.phase2.warmup_fraction) == (0.2843, 0.128)
    assert (config.phase1.seq_len, config.phase2.seq_len) == (128, 512)
