"""Codistillation through the real driver on CPU ranks (gloo): 2 groups x 1 rank and 2 groups x 2 ranks (ZeRO-2).

One module-scoped fixture runs three launches (tests/scripts/codistill_scenarios.py): the solo twins on
1 process, the 2-rank job (solo twins on 2 ranks + 2x1 codistillation: alpha 0, full, resumed, through
files) and the 4-rank job; the tests below only read what those runs recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch_util import REPO_ROOT, deepspeed_cpu_env, run_ranks
from tests.scripts.pretrain_fixtures import build_shards

SCRIPT = REPO_ROOT / "tests" / "scripts" / "codistill_scenarios.py"
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("codistill")
    build_shards(root / "shards")
    solo = subprocess.Popen([sys.executable, str(SCRIPT), "solo1", str(root)], env=deepspeed_cpu_env(),
                            cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_ranks(SCRIPT, ["two", str(root)], num_ranks=2, timeout=600)
    run_ranks(SCRIPT, ["four", str(root)], num_ranks=4, timeout=600)
    output, _ = solo.communicate(timeout=600)
    assert solo.returncode == 0, output[-6000:]
    return root


def own(run: Path, group: int, step: int) -> torch.Tensor:
    return torch.load(run / "record" / f"own_g{group}_s{step}.pt", weights_only=True)


def metrics(run: Path, group: int) -> list[dict]:
    lines = (run / f"group{group}" / "tensorboard" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize(("codistilled", "solo"), [("co2_alpha0", "solo1"), ("co4_alpha0", "solo2")])
def test_alpha_zero_groups_are_bit_identical_to_training_alone(workdir: Path, codistilled: str, solo: str) -> None:
    for group in range(2):
        together = own(workdir / codistilled, group, 5)
        alone = own(workdir / f"{solo}_g{group}", 0, 5)
        assert torch.equal(together, alone), f"{codistilled} group {group}: max diff {(together - alone).abs().max()}"
    # the two groups really are different models (different seeds), so the equality above is not vacuous
    assert not torch.equal(own(workdir / codistilled, 0, 5), own(workdir / codistilled, 1, 5))


@pytest.mark.parametrize(("run", "ranks", "expected"), [
    ("co2_full", 2, [2, 6, 7, 9]),  # burn-in 2, every 4, phase 2 starts at 7, final refresh at 9
    ("co4_refresh", 4, [2, 4, 5]),  # burn-in 2, every 2, final refresh at 5
    ("co2_zero3", 2, [2, 4, 5]),  # the same under ZeRO-3 (gathered parameters)
])
def test_teachers_refresh_at_configured_steps_with_the_other_groups_weights(
    workdir: Path, run: str, ranks: int, expected: list[int]
) -> None:
    record = workdir / run / "record"
    group_size = ranks // 2
    for rank in range(ranks):
        assert json.loads((record / f"refresh_log_r{rank}.json").read_text()) == expected
        group = rank // group_size
        for step in expected:
            state = torch.load(record / f"teacher_r{rank}_at{step}.pt", weights_only=True)
            assert state["refreshed_at"] == step and state["teacher_step"] == step
            assert set(state["teachers"]) == {1 - group}
            assert torch.equal(state["teachers"][1 - group], own(workdir / run, 1 - group, step)), (rank, step)


def test_distillation_is_off_during_burn_in_then_on(workdir: Path) -> None:
    for group in range(2):
        rows = [row for row in metrics(workdir / "co2_full", group) if "codistill/active" in row]
        by_step = {row["step"]: row for row in rows}
        assert sorted(by_step) == list(range(1, 10))
        for step in (1, 2):  # optimizer steps 0 and 1 < burn_in_steps = 2
            assert by_step[step]["codistill/distill_loss"] == 0.0 and by_step[step]["codistill/active"] == 0.0
        for step in range(3, 10):
            assert by_step[step]["codistill/active"] == 1.0 and by_step[step]["codistill/distill_loss"] > 0.0
            assert 0.0 <= by_step[step]["codistill/agreement"] <= 1.0
        # the teacher's age in steps: refreshed at 2 and 6, then at 7 (phase 2 start)
        assert [by_step[s]["codistill/teacher_age"] for s in range(3, 10)] == [0, 1, 2, 3, 0, 0, 1]


@pytest.mark.parametrize("other", ["co2_resume", "co2_files"])
def test_resume_and_filesystem_exchange_end_where_the_uninterrupted_collective_run_ends(
    workdir: Path, other: str
) -> None:
    for group in range(2):
        assert torch.equal(own(workdir / other, group, 9), own(workdir / "co2_full", group, 9)), (other, group)
    if other == "co2_resume":  # two invocations (stopped after step 3, then resumed): every step logged once
        for group in range(2):
            steps = [row["step"] for row in metrics(workdir / other, group) if "codistill/active" in row]
            assert steps == list(range(1, 10))


def test_final_numbers_and_exports_of_every_group(workdir: Path) -> None:
    finals = [json.loads((workdir / "co2_full" / f"group{g}" / "codistill_final.json").read_text()) for g in range(2)]
    for group, final in enumerate(finals):
        assert final["group"] == group and final["global_step"] == 9
        assert 0.0 <= final["codistill/final_churn"] <= 1.0
        for key in ("codistill/final_val_mlm_loss", "codistill/final_ensemble_val_mlm_loss"):
            assert 0.0 < final[key] < 10.0
        for phase in ("phase1", "phase2"):
            assert (workdir / "co2_full" / f"group{group}" / "export" / phase / "export_info.json").is_file()
    # both groups evaluate the same two models on the same batches: one ensemble, mirrored own/other losses
    assert finals[0]["codistill/final_ensemble_val_mlm_loss"] == pytest.approx(
        finals[1]["codistill/final_ensemble_val_mlm_loss"], rel=1e-5)
    assert finals[0]["codistill/final_val_mlm_loss"] == pytest.approx(
        finals[1]["codistill/final_teachers_val_mlm_loss"], rel=1e-5)
    assert finals[0]["codistill/final_churn"] == pytest.approx(finals[1]["codistill/final_churn"])

