"""Whole runs: padded/eager and unpadded/compiled train the same losses, through both phases, on 1 rank and on
2 ranks (ZeRO-2, ExactLamb), and a checkpoint moves between the paths both ways (dropout off).

One launch per world size (tests/scripts/unpadded_scenarios.py). Both exports load into transformers'
`BertForPreTraining` with no missing or unexpected key; the compiled steps log 0 graph breaks and a
handful of recompiles at most.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertForPreTraining

from tests.support.launching import run_ranks
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, step_records, tiny_run_config

SCRIPT = REPO_ROOT / "tests" / "scripts" / "unpadded_scenarios.py"
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
LOSSES = ("loss/total", "loss/mlm", "loss/nsp", "acc/mlm")
STEPS = [("phase1", s) for s in range(1, 7)] + [("phase2", s) for s in range(1, 5)]


def launch(work: Path, mode: str, ranks: int) -> Path:
    shards = build_shards(work / "shards")
    for name in ("padded", "unpadded"):
        path = tiny_run_config(work / f"{name}.json", shards, work / name)
        config = json.loads(path.read_text())
        config["model"]["overrides"] = NO_DROPOUT
        path.write_text(json.dumps(config))
    run_ranks(SCRIPT, [mode, str(work)], num_ranks=ranks, timeout=900)
    return work


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("unpadded_1rank"), "pure", 1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("unpadded_2ranks"), "crossing", 2)


def assert_same_training(work: Path) -> None:
    padded, unpadded = step_records(work / "padded"), step_records(work / "unpadded")
    assert sorted(padded) == sorted(unpadded) == STEPS
    for key in STEPS:
        for metric in LOSSES:
            assert unpadded[key][metric] == pytest.approx(padded[key][metric], rel=1e-4), (key, metric)
        if "val/mlm_loss" in padded[key]:
            assert unpadded[key]["val/mlm_loss"] == pytest.approx(padded[key]["val/mlm_loss"], rel=1e-4), key
    assert padded[STEPS[0]]["loss/total"] != padded[STEPS[-1]]["loss/total"]  # it trained


def assert_exports_load_into_transformers(work: Path) -> None:
    exported = {}
    for name in ("padded", "unpadded"):
        folder = work / name / "export" / "phase2"
        _, info = BertForPreTraining.from_pretrained(str(folder), local_files_only=True, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        exported[name] = load_file(folder / "model.safetensors")
    assert exported["padded"].keys() == exported["unpadded"].keys()
    for key, value in exported["padded"].items():
        torch.testing.assert_close(exported["unpadded"][key], value, rtol=1e-3, atol=1e-4, msg=key)


def compiled_rows(work: Path) -> list[dict]:
    return [r for r in step_records(work / "unpadded").values() if "compile/graph_breaks" in r]


@pytest.mark.multirank
def test_one_rank_unpadded_compiled_trains_like_padded_eager(one_rank: Path) -> None:
    assert json.loads((one_rank / "outcomes.json").read_text()) == {"padded": 0, "unpadded": 0}
    assert_same_training(one_rank)
    assert_exports_load_into_transformers(one_rank)
    rows = compiled_rows(one_rank)
    assert len(rows) == len(STEPS)
    assert all(r["compile/graph_breaks"] == 0 and r["compile/recompiles"] <= 4 for r in rows), rows[-1]
    assert rows[-1]["compile/seconds"] > 0
    from pretrain.report import write as report

    assert report.main([str(one_rank / "unpadded")]) == 0  # the run summary says what compiling cost
    summary = (one_rank / "unpadded" / "report.md").read_text()
    assert f"| compiled layers | {rows[-1]['compile/seconds']:.1f} s compiling, 0 graph breaks" in summary


@pytest.mark.multirank
def test_two_rank_zero2_checkpoints_cross_between_the_paths(two_ranks: Path) -> None:
    outcomes = json.loads((two_ranks / "outcomes.json").read_text())
    assert outcomes == {"padded": 0, "unpadded_first_4": 0, "padded_next_4": 0, "unpadded_rest": 0}
    assert_same_training(two_ranks)
    assert_exports_load_into_transformers(two_ranks)
    rows = step_records(two_ranks / "unpadded")
    compiled = {key for key, r in rows.items() if "compile/graph_breaks" in r}
    # phase-1 steps 1-4 and phase-2 steps 3-4 ran compiled; the 4 steps between, padded and eager
    assert compiled == {("phase1", s) for s in range(1, 5)} | {("phase2", 3), ("phase2", 4)}
    assert all(rows[key]["compile/graph_breaks"] == 0 and rows[key]["compile/recompiles"] <= 4 for key in compiled)
