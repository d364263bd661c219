"""Shards are checked for their values, not only their bytes: a shard whose checksum was re-recorded after a bad
write passes the sha256 check, yet an id >= the vocab size crashes the forward pass at whichever step draws it
(on a GPU a device-side assert, again after every restart), and a static masked position beyond its instance
labels another instance's token in the unpadded layout. Rank 0 refuses both before training, in one line naming
the shard, the row and the value. Shards come from the real `python -m data_prep build` (static masking)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.shard_format.shards import Manifest, read_table, write_shard_table
from pretrain.config.load import load_config
from pretrain.data.batches import Collator, DataConfigError, open_phase_data
from pretrain.distributed.info import DistInfo
from pretrain.plan.run_plan import plan_run
from tests.data_prep.segment_inputs import build, write_inputs
from tests.support.launching import deepspeed_cpu_env
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import tiny_run_config

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SHARD = "seq32/train-00000.arrow"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Static-masked shards at the tiny run's two lengths, as data_prep builds them."""
    root = tmp_path_factory.mktemp("static")
    corpus = write_inputs(root / "inputs")
    assert build(corpus, root / "shards", "--seq-lens", "32,64", "--masking", "static", "--num-shards", "2",
                 "--val-fraction", "0.1", "--docs-per-chunk", "16") == 0
    return root / "shards"


def tampered(built: Path, out: Path, column: str, change: Callable[[list[list[int]], list[int]], None]) -> Path:
    """A copy of the shards whose first training shard at seq 32 has `change(values of column, lengths)` applied,
    written by the shard writer and its sha256 recorded in the manifest again: the byte check passes."""
    shutil.copytree(built, out)
    table = read_table(out / SHARD)
    values = table.column(column).to_pylist()
    change(values, [len(ids) for ids in table.column("input_ids").to_pylist()])
    field = table.schema.field(column)
    _, sha = write_shard_table(out / SHARD, table.set_column(table.schema.get_field_index(column), field,
                                                             pa.array(values, field.type)))
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    for shard in manifest["seq_lens"]["32"]["train"]["shards"]:
        if shard["file"] == SHARD:
            shard["sha256"] = sha
    atomic_write_json(out / "manifest.json", manifest)
    Manifest.load(out).verify(32, "train", checksums=True)  # the bytes check alone accepts it
    return out


def an_id_beyond_the_vocab(ids: list[list[int]], lengths: list[int]) -> None:
    ids[3][2] = 65000


def a_position_beyond_the_instance(positions: list[list[int]], lengths: list[int]) -> None:
    positions[5][0] = lengths[5] + 2  # inside seq_len, past its own tokens: the next instance's in the flat layout


def test_the_real_builds_shards_pass_the_value_check(built: Path, tmp_path: Path) -> None:
    plan = plan_run(load_config(str(tiny_run_config(tmp_path / "run.json", built, tmp_path / "run"))), ONE,
                    verify_checksums=True)
    assert plan.ds_configs["phase1"]["train_micro_batch_size_per_gpu"] == 4


def test_an_id_beyond_the_vocab_is_refused_before_training_in_one_line(built: Path, tmp_path: Path) -> None:
    shards = tampered(built, tmp_path / "shards", "input_ids", an_id_beyond_the_vocab)
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "pretrain.train", "--config",
                           str(tiny_run_config(tmp_path / "run.json", shards, run))],
                          cwd=REPO_ROOT, env=deepspeed_cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    size = Manifest.load(shards).vocab_size
    assert lines == [f"config error: data.shards: {shards / SHARD}: row 3: token id 65000 outside the vocab "
                     f"(ids 0 to {size - 1}); rebuild the shards (python -m data_prep build)"]
    assert not (run / "checkpoints").exists() and "step" not in done.stdout


def test_a_static_position_beyond_its_instance_is_refused_by_the_plan(built: Path, tmp_path: Path) -> None:
    shards = tampered(built, tmp_path / "shards", "masked_positions", a_position_beyond_the_instance)
    config = load_config(str(tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")))
    length = len(read_table(shards / SHARD).column("input_ids")[5])
    with pytest.raises(ValueError) as err:
        plan_run(config, ONE, verify_checksums=True)
    assert str(err.value) == (f"data.shards: {shards / SHARD}: row 5: masked position {length + 2} outside its "
                              f"instance of {length} tokens (it would label another instance's token); rebuild "
                              "the shards (python -m data_prep build)")
    plan_run(config, ONE, verify_checksums=False)  # unchecked: the collate's own guard is the last line


def test_a_next_sentence_label_the_format_lacks_is_refused_by_the_plan(built: Path, tmp_path: Path) -> None:
    """Label 7 would fail the NSP loss at whichever step draws it (a device-side assert on a GPU, every restart)."""
    def label_seven(labels: list[int], lengths: list[int]) -> None:
        labels[6] = 7

    shards = tampered(built, tmp_path / "shards", "next_sentence_label", label_seven)
    config = load_config(str(tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")))
    with pytest.raises(ValueError) as err:
        plan_run(config, ONE, verify_checksums=True)
    assert str(err.value) == (f"data.shards: {shards / SHARD}: row 6: next_sentence_label 7 (the format's are 0, 1, "
                              "-1); rebuild the shards (python -m data_prep build)")


@pytest.mark.parametrize("layout", ["padded", "packing", "unpadded"])
def test_unchecked_shards_never_label_another_instances_token(built: Path, tmp_path: Path, layout: str) -> None:
    """data.verify_checksums=false skips the check: the collate refuses the row itself, in every layout."""
    shards = tampered(built, tmp_path / "shards", "masked_positions", a_position_beyond_the_instance)
    data = open_phase_data(shards, 32, None, "data.shards", verify_checksums=False)
    collate = Collator(data, packing=layout == "packing", unpadded=layout == "unpadded")
    from data_prep.shard_format.shards import ShardReader

    reader = ShardReader(data.manifest, 32)
    collate([reader[i] for i in range(4)], None)  # the rows before it collate as ever
    with pytest.raises(DataConfigError, match=r"masked position \d+ lies outside its instance of \d+ tokens"):
        collate([reader[i] for i in range(4, 8)], None)
    ids = reader[3]
    ids["input_ids"] = np.append(ids["input_ids"][:-1], 65000)
    with pytest.raises(DataConfigError, match="token id 65000 is outside the vocab"):
        collate([ids], None)


def test_a_shard_without_the_columns_the_check_reads_is_refused_naming_them(built: Path, tmp_path: Path) -> None:
    from pretrain.data.shard_values import ShardValueError, ValueLimits, check_shard

    table = read_table(built / SHARD).drop_columns(["masked_label_ids"])
    write_shard_table(tmp_path / "half.arrow", table)
    with pytest.raises(ShardValueError, match="column masked_positions without its pair"):
        check_shard(tmp_path / "half.arrow", None, ValueLimits(vocab_size=100, seq_len=32))
    floats = pa.table({"input_ids": pa.array([[1.0, 2.0]]), "a_len": pa.array([2], pa.uint16())})
    write_shard_table(tmp_path / "floats.arrow", floats)
    with pytest.raises(ShardValueError, match="column input_ids is list<item: double>, not a list of integer ids"):
        check_shard(tmp_path / "floats.arrow", None, ValueLimits(vocab_size=100, seq_len=32))
