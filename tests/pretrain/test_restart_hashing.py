"""An elastic agent's restart after a fault does not hash the shards again when its launch's first start did:
on a real corpus that hashing (rank 0 alone, every rank waiting) is the longest part of a restart's start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.config.load import load_config
from pretrain.distributed.info import DistInfo, Launch
from pretrain.plan.run_plan import record_verified, verified_in_this_launch
from pretrain.run_folder import shards_verified_path
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_a_restart_of_the_launch_that_hashed_skips_it_and_nothing_else_does(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    shards = build_shards(tmp_path / "shards", seq_lens=(32, 64), train=16, val=8)
    config = load_config(str(tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")))
    first, restart = Launch("bert-job-1", 0), Launch("bert-job-1", 2)
    assert not verified_in_this_launch(config, restart)  # nothing recorded yet: hash
    record_verified(config, first, seconds=1.5)
    record = json.loads(shards_verified_path(tmp_path / "run").read_text())
    assert record["launch"] == "bert-job-1" and set(record["manifests"]) == {"phase1", "phase2"}
    assert verified_in_this_launch(config, restart)
    assert "note: restart 2 of launch bert-job-1: the shards were hashed at its start (1.5 s); not again" in \
        capsys.readouterr().out
    assert not verified_in_this_launch(config, first)  # a launch's first start always hashes
    assert not verified_in_this_launch(config, Launch("bert-job-2", 1))  # another launch (a requeue) hashes
    assert not verified_in_this_launch(config, Launch(None, 0))  # no agent
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["tool_version"] = "rebuilt"  # the shards changed under the run: hash again
    (shards / "manifest.json").write_text(json.dumps(manifest))
    assert not verified_in_this_launch(config, restart)
    off = load_config(str(tmp_path / "run.json"), ["--data.verify_checksums=false"])
    record_verified(off, first, seconds=0.1)  # nothing to record when hashing is off
    assert json.loads(shards_verified_path(tmp_path / "run").read_text())["seconds"] == 1.5
