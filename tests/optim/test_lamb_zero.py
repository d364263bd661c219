"""ExactLamb under ZeRO 0/1/2/3 and BF16_Optimizer on 2 CPU ranks equals a single-process ExactLamb.

One launch of tests/scripts/lamb_zero_equality.py runs every scenario (a 2-rank launch costs ~20 s of
startup); this module asserts on the JSON it writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.launching import finish_ranks, run_ranks, start_ranks
from tests.support.paths import SCRIPTS

SCRIPT = SCRIPTS / "lamb_zero_equality.py"
FP32_EXACT = [
    "stage0",
    "stage1",
    "stage2",
    "stage3",
    "stage3_subgroups",
    "stage2_foreach",
    "stage3_foreach",
    "stage2_round_robin",
    "stage2_accum_clip",
    "stage1_trust_clip_no_adapt",
    "stage2_offload",
    "stage3_offload",
    "stage2_checkpoint",
    "stage3_checkpoint",
]
DISTINCT_DATA = ["stage2_distinct_data", "stage3_distinct_data"]
BF16 = ["bf16_optimizer", "stage2_bf16"]
FUSED = ["stage2_fused", "stage3_fused"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lamb_zero") / "results.json"
    scenarios = ["unbound", *FP32_EXACT, *DISTINCT_DATA, *BF16, *FUSED, "naive_stage0", "naive_stage2"]
    run_ranks(SCRIPT, ["--out", str(out), "--scenarios", ",".join(scenarios)], num_ranks=2, timeout=600)
    return json.loads(Path(out).read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", FP32_EXACT)
def test_zero_fp32_equals_single_process_lamb(results: dict[str, Any], scenario: str) -> None:
    result = results[scenario]
    assert results["world_size"] == 2
    assert result["max_abs_diff"] <= 1e-6, result
    assert result["max_ratio_diff"] <= 1e-5, result  # the per-parameter trust ratios themselves
    assert len(result["ratios"]) == 7  # one ratio per original parameter, not per flat partition


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", FUSED)
def test_fused_kernels_under_zero_equal_single_process_lamb(results: dict[str, Any], scenario: str) -> None:
    """The torch.compile'd flat step (the CUDA default) through a real engine: ZeRO-2 with accumulation and
    clipping, and ZeRO-3. Within pretrain/optim/fused_lamb.py's documented tolerance (rtol 1e-5)."""
    result = results[scenario]
    assert result["fused_compiled"] is True, result  # the compiled kernels ran, not the eager fallback
    assert result["max_abs_diff"] <= 1e-6, result
    assert result["max_ratio_diff"] <= 1e-5, result
    assert result["wrapper"] == ("DeepSpeedZeroOptimizer" if scenario == "stage2_fused" else
                                 "DeepSpeedZeroOptimizer_Stage3")


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", DISTINCT_DATA)
def test_zero_with_distinct_data_per_rank(results: dict[str, Any], scenario: str) -> None:
    # Each rank its own rows: the reduced gradient differs from the single-process one by rounding
    # (~1 ulp), which Adam can amplify where |g| << eps; at BERT's lr it stays far below the bound.
    result = results[scenario]
    assert result["max_abs_diff"] <= 1e-6, result
    assert result["max_rel_l2"] <= 1e-6, result
    assert result["max_ratio_diff"] <= 1e-5, result


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", [*FP32_EXACT, *DISTINCT_DATA, *BF16, *FUSED])
def test_gradient_norm_per_group_equals_the_whole_gradients(results: dict[str, Any], scenario: str) -> None:
    """grad_norm/<group> as the step monitor logs it on 2 ranks (pretrain/metrics/grad_groups.py: each rank's
    slices of the flat partitions, all-reduced, the clipping undone) equals the norm of the reference's whole
    gradient before clipping, group by group and step by step; the groups' squares add up to DeepSpeed's own
    global norm. Straddling parameters, ZeRO-3 padding and sub-groups, round-robin order, offload, clipping and
    a checkpoint reload are among the scenarios."""
    result = results[scenario]
    logged, reference = result["group_norms"], result["ref_group_norms"]
    assert len(logged) == len(reference) > 0
    rel = 2e-2 if scenario in BF16 else 1e-5  # bf16 gradients differ from the fp32 reference's
    for step, (mine, whole) in enumerate(zip(logged, reference, strict=True)):
        groups = {tag: value for tag, value in mine.items() if tag.startswith("grad_norm/")}
        assert groups == pytest.approx(whole, rel=rel), (step, groups, whole)
        if "grad_norm" in mine:  # a wrapper reported its norm (every stage but ZeRO-0)
            assert sum(v * v for v in groups.values()) ** 0.5 == pytest.approx(mine["grad_norm"], rel=1e-5), step


@pytest.mark.multirank
def test_layouts_exercise_boundaries_padding_and_wrappers(results: dict[str, Any]) -> None:
    # ZeRO-1/2: at least one parameter is cut by the partition boundary (odd sizes, 2 ranks).
    assert results["stage2"]["straddling"] and results["stage2"]["wrapper"] == "DeepSpeedZeroOptimizer"
    # round_robin_gradients reorders the flat buffer: a different parameter straddles.
    assert results["stage2_round_robin"]["straddling"] != results["stage2"]["straddling"]
    # ZeRO-3: every odd-sized parameter ends in uninitialised padding on the last rank.
    assert len(results["stage3"]["zero3_padded"]) == 7
    assert results["stage3"]["wrapper"] == "DeepSpeedZeroOptimizer_Stage3"
    assert results["bf16_optimizer"]["wrapper"] == "BF16_Optimizer"


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", BF16)
def test_bf16_tracks_fp32_reference(results: dict[str, Any], scenario: str) -> None:
    result = results[scenario]
    # bf16 gradients differ from fp32 ones, so equality is approximate; the naive LAMB is ~0.9 off.
    assert result["max_rel_l2"] <= 2e-2, result
    assert result["max_ratio_diff"] <= 1e-2, result


@pytest.mark.multirank
def test_naive_lamb_under_zero2_differs(results: dict[str, Any]) -> None:
    # The same textbook LAMB equals the reference without ZeRO, and is visibly wrong under ZeRO-2.
    assert results["naive_stage0"]["max_abs_diff"] <= 1e-6
    assert results["naive_stage2"]["max_abs_diff"] >= 1e-2
    assert results["naive_stage2"]["max_rel_l2"] >= 0.1


@pytest.mark.multirank
def test_unbound_lamb_under_zero_refuses_to_step(results: dict[str, Any]) -> None:
    assert "bind_zero_layout(engine)" in results["unbound"]["error"]


@pytest.mark.multirank
def test_cpu_jobs_leave_no_shared_memory_segments_behind(tmp_path: Path) -> None:
    """DeepSpeed's CPU all-reduce creates a ~66 MiB /dev/shm segment per rank and never unlinks it;
    pretrain.engine.init_distributed unlinks them once all ranks are attached (RAM comes back at exit)."""
    job = start_ranks(SCRIPT, ["--out", str(tmp_path / "r.json"), "--scenarios", "stage0"], num_ranks=2)
    port = job.args[job.args.index("--master-port") + 1]
    done = finish_ranks(job, timeout=300)
    if "deepspeed_shm_comm_op built successfully" not in done.stdout + done.stderr:
        pytest.skip("DeepSpeed's CPU shared-memory all-reduce is not available on this machine")
    assert json.loads((tmp_path / "r.json").read_text())["stage0"]["max_abs_diff"] <= 1e-6  # it did all-reduce
    left = sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert left == []
