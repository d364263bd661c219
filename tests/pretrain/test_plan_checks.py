"""A DeepSpeed JSON that an engine would refuse, or that sets what the run config owns, is refused for every
phase before phase 1 trains.

Before, a phase-2 JSON with bf16 at ZeRO stage 0 or an unknown LAMB key crashed with a traceback
when phase 2's engine was built: after the whole of phase 1. Now `pretrain.train.main` exits 2 with
one line naming the phase, its file and the key, and nothing is trained or written. A JSON in the previous
layout (batch sizes, lr, bf16 in the DeepSpeed file) is refused the same way, naming the run-config key
to move each value to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.train import main
from tests.support.pretrain_fixtures import REPO_ROOT, build_shards, tiny_run_config

BASE_DS = json.loads((REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json").read_text())


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tmp_path_factory.mktemp("plan_checks") / "shards", train=32, val=8)


@pytest.mark.parametrize(
    ("change", "overrides", "expected"),
    [
        ({"optimizer": {"params": {"max_grad_norm": 1.0}}}, [], "unknown key(s) ['max_grad_norm']"),
        ({"optimizer": {"params": {"betas": [0.9, 1.5]}}}, [], "betas must be two values in [0, 1)"),
        ({"zero_optimization": {"stage": 0}}, ["--run.precision=bf16"], 'needs "zero_optimization": {"stage": 1}'),
        ({"optimizer": {"type": "lamb"}}, [], "CUDA-only FusedLamb"),
        ({"train_batch_size": 64, "optimizer": {"params": {"lr": 6e-3}}}, [],
         "train_batch_size, optimizer.params.lr belong to the run config: set phase2.batch_size=64, phase2.lr=0.006 "
         "in RUN.json and remove them here"),
    ],
    ids=["unknown-lamb-key", "bad-beta", "bf16-at-stage-0", "deepspeed-lamb", "previous-layout"],
)
def test_a_bad_phase2_json_is_a_config_error_before_phase1(
    tmp_path: Path, shards: Path, capsys: pytest.CaptureFixture[str], change: dict, overrides: list[str],
    expected: str,
) -> None:
    from pretrain.ds_config import deep_merge

    bad = tmp_path / "phase2_ds.json"
    bad.write_text(json.dumps(deep_merge(BASE_DS, change)))
    run_json = tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")
    code = main(["--config", str(run_json), f"--phase2.ds_config={bad}", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("config error: ") and "phase2.ds_config" in err[0], err
    assert str(bad) in err[0] and expected in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()  # phase 1 never started
