"""Codistillation through the real driver on CPU ranks (gloo): 2 groups x 1 rank and 2 groups x 2 ranks (ZeRO-2).

One module-scoped fixture runs the launches of tests/scripts/codistill_scenarios.py: the 2-rank job (solo
twins on 2 ranks + 2x1 codistillation: alpha 0, full, resumed, through files, ZeRO-3, a NaN abort), the
4-rank job, the two groups as separate one-process jobs that meet only through files (each runs its group's
solo twin on 1 process first), and as separate 2-rank jobs; the tests below only read what those runs
recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launching import REPO_ROOT, deepspeed_cpu_env, finish_ranks, run_ranks, start_ranks
from tests.support.paths import SCRIPTS
from tests.support.pretrain_fixtures import build_shards

SCRIPT = SCRIPTS / "codistill_scenarios.py"
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("codistill")
    build_shards(root / "shards")
    # one-process runs next to the launches: the two separate jobs (they must overlap), each after its solo twin
    lone = [subprocess.Popen([sys.executable, str(SCRIPT), scenario, str(root)], env=deepspeed_cpu_env(),
                             cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for scenario in ("job0", "job1")]
    run_ranks(SCRIPT, ["two", str(root)], num_ranks=2, timeout=600)
    run_ranks(SCRIPT, ["four", str(root)], num_ranks=4, timeout=600)
    jobs = [start_ranks(SCRIPT, [scenario, str(root)], num_ranks=2) for scenario in ("job0x2", "job1x2")]
    for job in jobs:
        finish_ranks(job, timeout=600)
    for process in lone:
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-6000:]
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
    ("co2_bf16", 2, [2, 4]),  # bf16: teachers hold the other group's bf16 module weights
])
def test_teachers_refresh_at_configured_steps_with_the_other_groups_weights(
    workdir: Path, run: str, ranks: int, expected: list[int]
) -> None:
    record = workdir / run / "record"
    group_size = ranks // 2
    for rank in range(ranks):
        group, group_rank = divmod(rank, group_size)
        assert json.loads((record / f"refresh_log_g{group}r{group_rank}.json").read_text()) == expected
        for step in expected:
            state = torch.load(record / f"teacher_g{group}r{group_rank}_at{step}.pt", weights_only=True)
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


@pytest.mark.parametrize(("other", "reference", "last"), [
    ("co2_resume", "co2_full", 9), ("co2_files", "co2_full", 9), ("co4_files", "co4_refresh", 5)])
def test_resume_and_filesystem_exchange_end_where_the_uninterrupted_collective_run_ends(
    workdir: Path, other: str, reference: str, last: int
) -> None:
    for group in range(2):
        assert torch.equal(own(workdir / other, group, last), own(workdir / reference, group, last)), (other, group)
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



def test_groups_read_disjoint_parts_of_the_training_data(workdir: Path) -> None:
    """Every instance each group's ranks read in phase 1 (recorded from their own data streams): both groups
    read, and they share no instance; the parts the groups resolve to say so too."""
    record = workdir / "co2_full" / "record"
    read = {group: set().union(*(json.loads(path.read_text()) for path in record.glob(f"read_g{group}r*.json")))
            for group in range(2)}
    assert read[0] and read[1] and not read[0] & read[1], {g: len(r) for g, r in read.items()}
    for group in range(2):
        resolved = json.loads((workdir / "co2_full" / f"group{group}" / "config.resolved.json").read_text())
        assert (resolved["data"]["part"], resolved["data"]["num_parts"]) == (group, 2)


def test_separate_jobs_meet_through_files_and_stay_their_own_runs(workdir: Path) -> None:
    """Two one-process jobs (codistill.group 0 and 1, alpha 0): each equals its solo twin bit for bit;
    each teacher is the other job's weights at the step it had published, whatever its staleness."""
    run = workdir / "sep"
    for group in range(2):
        assert torch.equal(own(run, group, 5), own(workdir / f"solo1_g{group}", 0, 5)), group
        record = run / "record"
        assert json.loads((record / f"refresh_log_g{group}r0.json").read_text()) == [2, 4, 5]
        for step in (2, 4, 5):
            state = torch.load(record / f"teacher_g{group}r0_at{step}.pt", weights_only=True)
            published = state["teacher_steps"][1 - group]
            assert 2 <= published <= 5 and state["teacher_step"] == published
            assert torch.equal(state["teachers"][1 - group], own(run, 1 - group, published)), (group, step)
        final = json.loads((run / f"group{group}" / "codistill_final.json").read_text())
        assert final["teacher_steps"] == {str(1 - group): 5}  # the end waits for the other's final weights
        assert 0.0 <= final["codistill/final_churn"] <= 1.0
        # each job exports only its own group
        assert (run / f"group{group}" / "export" / "phase1" / "export_info.json").is_file()
        rows = [row for row in metrics(run, group) if "codistill/active" in row]
        assert [row["codistill/active"] for row in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_a_diverging_group_stops_every_group_at_the_same_checkpoint(workdir: Path) -> None:
    """Group 1 sees NaN losses from step 3; after failures.max_consecutive_nonfinite = 2 both groups save
    phase1 step 5 and exit with code 3 (the scenario asserts the code) instead of group 0 hanging."""
    for group in range(2):
        checkpoints = workdir / "co2_nan" / f"group{group}" / "checkpoints"
        assert (checkpoints / "latest").read_text().strip() == "phase1-step0000005"
        state = json.loads((checkpoints / "phase1-step0000005" / "trainer_state.json").read_text())
        assert state["consecutive_nonfinite"] == (2 if group == 1 else 0)


def test_bf16_groups_distill_in_their_compute_dtype(workdir: Path) -> None:
    state = torch.load(workdir / "co2_bf16" / "record" / "teacher_g0r0_at4.pt", weights_only=True)
    assert state["teachers"][1].dtype == torch.bfloat16
    for group in range(2):
        rows = [row for row in metrics(workdir / "co2_bf16", group) if row.get("codistill/active") == 1.0]
        assert [row["step"] for row in rows] == [3, 4]
        assert all(0.0 < row["codistill/distill_loss"] < 50.0 for row in rows)


def test_separate_jobs_of_two_ranks_share_one_teacher_per_group_and_distill(workdir: Path) -> None:
    run, record = workdir / "sepx2", workdir / "sepx2" / "record"
    for group in range(2):
        for step in (2, 4, 5):
            states = [torch.load(record / f"teacher_g{group}r{r}_at{step}.pt", weights_only=True) for r in range(2)]
            assert states[0]["teacher_steps"] == states[1]["teacher_steps"]  # rank 1 got rank 0's verdict
            assert torch.equal(states[0]["teachers"][1 - group], states[1]["teachers"][1 - group])
            published = states[0]["teacher_steps"][1 - group]
            assert torch.equal(states[0]["teachers"][1 - group], own(run, 1 - group, published)), (group, step)
        rows = {row["step"]: row for row in metrics(run, group) if "codistill/active" in row}
        assert [rows[s]["codistill/active"] for s in range(1, 6)] == [0.0, 0.0, 1.0, 1.0, 1.0]
        assert all(rows[s]["codistill/distill_loss"] > 0.0 for s in (3, 4, 5))
        final = json.loads((run / f"group{group}" / "codistill_final.json").read_text())
        assert final["teacher_steps"] == {str(1 - group): 5}


def test_a_crashing_group_ends_the_whole_job_instead_of_leaving_the_other_waiting(
    tmp_path_factory: pytest.TempPathFactory, workdir: Path
) -> None:
    """Group 1 raises at step 3 while group 0 is about to enter the next world collective: the deepspeed
    launcher kills every rank, so the job ends in seconds with the error, not at the gloo/NCCL timeout."""
    root = tmp_path_factory.mktemp("codistill_crash")
    (root / "shards").symlink_to(workdir / "shards")
    job = start_ranks(SCRIPT, ["crash", str(root)], num_ranks=2)
    try:
        stdout, stderr = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job hung after one group crashed")
    assert job.returncode != 0
    assert "injected crash in group 1" in stdout + stderr
    assert not (root / "co2_crash" / "group0" / "codistill_final.json").exists()
