"""Integration: shards built by `python -m data_prep build` from ../shared/data, then a two-phase run
on 2 CPU ranks (ZeRO-2, ExactLamb): checkpoints of both phases, exact resume, a falling MLM loss,
and exports that transformers loads offline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launching import REPO_ROOT, deepspeed_cpu_env, run_ranks
from tests.support.pretrain_fixtures import PRETRAIN_SCENARIOS as SCRIPT
from tests.support.pretrain_fixtures import step_records, tiny_run_config


@pytest.mark.multirank
@pytest.mark.shared_data
def test_two_phase_run_on_real_shards(shared_data: Path, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    subprocess.run(
        [sys.executable, "-m", "data_prep", "build",
         "--wikiextractor", str(shared_data / "wikipedia" / "wikiextractor_sample"),
         "--text", str(shared_data / "books" / "bert_sample_text.txt"),
         "--vocab-size", "2000", "--seq-lens", "64,128", "--val-fraction", "0.1",
         "--out", str(shards), "--seed", "1", "--workers", "1"],
        check=True, cwd=REPO_ROOT, env=deepspeed_cpu_env(), capture_output=True, text=True,
    )
    for name in ("A", "B"):
        path = tiny_run_config(tmp_path / f"run{name}.json", shards, tmp_path / name, phase1=24, phase2=4)
        config = json.loads(path.read_text())
        config["phase1"].update(seq_len=64, lr=5e-2, warmup_fraction=0.1)
        config["phase2"].update(seq_len=128)
        config["checkpoint"]["every_steps"] = 100
        config["logging"]["val_every_steps"] = 12
        path.write_text(json.dumps(config))
    run_ranks(SCRIPT, ["shared", str(tmp_path)], num_ranks=2, timeout=600)

    assert json.loads((tmp_path / "outcomes.json").read_text()) == {"a": 0, "b_stopped": 0, "b_finished": 0}
    for tag in ("phase1-step0000024", "phase2-step0000004"):
        assert (tmp_path / "A" / "checkpoints" / tag / "PHASE_END").exists()
    reference, resumed = step_records(tmp_path / "A"), step_records(tmp_path / "B")
    assert len(reference) == 28 and sorted(reference) == sorted(resumed)
    assert all(resumed[k]["loss/total"] == reference[k]["loss/total"] for k in reference)
    mlm = [reference[("phase1", s)]["loss/mlm"] for s in range(1, 25)]
    assert sum(mlm[-4:]) / 4 < sum(mlm[:4]) / 4 - 0.3, mlm  # it learns: ln(2000) = 7.6 at the start
    val = [json.loads(line) for line in (tmp_path / "A" / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    val_losses = [r["val/mlm_loss"] for r in val if "val/mlm_loss" in r]
    assert len(val_losses) >= 2 and val_losses[1] < val_losses[0]

    from transformers import AutoModelForPreTraining

    for phase in ("phase1", "phase2"):
        model = AutoModelForPreTraining.from_pretrained(str(tmp_path / "A" / "export" / phase), local_files_only=True)
        assert model.config.vocab_size == 2000
