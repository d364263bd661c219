"""bench/gpu_check/estimate.py on made-up rows (the wall-clock model, by hand), and bench/gpu_check/plan.py:
the rows run at the shipped recipe's own micro-batches, most important first. Pure functions: no engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu_check.args import OLDER_GPU, parse_args
from bench.gpu_check.estimate import Network, PhaseRun, comparisons, estimate, estimate_markdown, step_times
from bench.gpu_check.plan import LAMB_STAGE, SELFTEST_STAGE, build_plan, row_names
from pretrain.config.load import load_config
from tests.support.paths import REPO_ROOT

P = 335_000_000  # made-up parameter count
NET = Network(gpus_per_node=8, intra_node_busbw_gbs=400.0, inter_node_busbw_gbs=50.0, intra_node_latency_us=10.0,
              inter_node_latency_us=100.0, small_collectives=3)


def row(name: str, step_s: float, accumulation: int, profile: str = "padded", packing: bool = False,
        timer: bool = False, micro: int = 64, seq: int = 128, **extra: object) -> dict[str, object]:
    return {"kind": "train", "status": "ok", "name": name, "model": "bert-large", "seq_len": seq, "micro_batch": micro,
            "accumulation": accumulation, "profile": profile, "packing": packing, "tput_timer": timer,
            "step_s": step_s, "lamb_step": "fused", "params": P, **extra}


def phase_run(packing: bool = False, batch: int = 65536, micro: int = 64, seq: int = 128) -> PhaseRun:
    return PhaseRun("bert_large_64k", "phase1", "bert-large", seq, micro, batch, 7038, packing, grad_bytes=4)


ROWS = [row("p1", 1.5, 32), row("p1-opt", 0.06, 1), row("p1-timer-on", 3.0, 32, timer=True),
        {"kind": "lamb", "status": "ok", "model": "bert-large", "variant": "fused", "step_ms": 8.0}]


def test_two_rows_of_one_engine_separate_the_micro_batch_from_the_optimizer_boundary() -> None:
    times = step_times(ROWS, phase_run())
    boundary = (32 * 0.06 - 1.5) / 31  # A T_1 - T_A over A - 1
    assert times.boundary_s == pytest.approx(boundary) and times.micro_s == pytest.approx((1.5 - boundary) / 32)
    assert times.lamb_s == pytest.approx(0.008) and times.params == P
    assert times.source == "p1, boundary from p1 and p1-opt"  # the timer-on row is never used


def test_step_model_by_hand_within_a_node_and_across_nodes() -> None:
    times = step_times(ROWS, phase_run())
    by_gpus = {e["gpus"]: e for e in estimate([phase_run()], ROWS, [1, 8, 64], NET)}
    for gpus, busbw, latency in ((8, 400e9, 10e-6), (64, 50e9, 100e-6)):
        e = by_gpus[gpus]
        a = 65536 // (64 * gpus)
        share = (gpus - 1) / gpus
        comm = (P * 4 * 2 * share + P * 2 * share) / busbw + 3 * latency  # fp32 all-reduce + bf16 all-gather
        optimizer = 0.008 / gpus + (times.boundary_s - 0.008)
        step = a * times.micro_s + optimizer + comm
        assert e["accumulation"] == a and e["comm_ms"] == pytest.approx(comm * 1e3)
        assert e["step_s"] == pytest.approx(step) and e["wall_s"] == pytest.approx(7038 * step)
        assert e["seq_per_s"] == pytest.approx(65536 / step)
    one = by_gpus[1]
    assert one["comm_ms"] == 0 and one["step_s"] == pytest.approx(1024 * times.micro_s + times.boundary_s)


def test_a_packed_recipe_uses_the_packed_row_with_the_padded_rows_boundary() -> None:
    rows = [*ROWS, row("p2-packed", 1.0, 32, profile="varied", packing=True)]
    times = step_times(rows, phase_run(packing=True))
    boundary = (32 * 0.06 - 1.5) / 31
    assert times.micro_s == pytest.approx((1.0 - boundary) / 32)
    assert times.source == "p2-packed, boundary from p1 and p1-opt (varied lengths, packed)"


def test_an_unpadded_recipe_uses_its_unpadded_rows_and_their_boundary() -> None:
    """model.attention=unpadded: the unpadded rows (the layout the run has), the boundary from the unpadded pair
    at A and at 1 micro-batch per step; padded rows never stand in (they would be a slower layout)."""
    rows = [*ROWS, row("p2", 0.8, 32, profile="varied", unpadded=True),
            row("p2-opt", 0.05, 1, profile="varied", unpadded=True)]
    unpadded = PhaseRun("bert_large_64k", "phase2", "bert-large", 128, 64, 32768, 1563, True, 4, unpadded=True)
    times = step_times(rows, unpadded)
    boundary = (32 * 0.05 - 0.8) / 31
    assert times.boundary_s == pytest.approx(boundary) and times.micro_s == pytest.approx((0.8 - boundary) / 32)
    assert times.source == "p2, boundary from p2 and p2-opt (varied lengths, unpadded)"
    assert step_times(ROWS, unpadded) == "no unpadded row of bert-large at seq 128 x micro 64"


def test_what_cannot_be_estimated_says_why() -> None:
    missing = estimate([phase_run(micro=16, seq=512)], ROWS, [8], NET)
    assert missing == [{"recipe": "bert_large_64k", "phase": "phase1", "gpus": 8,
                        "status": "no padded row of bert-large at seq 512 x micro 16"}]
    (odd,) = estimate([phase_run(batch=65536 + 64)], ROWS, [8], NET)
    assert odd["status"] == "batch 65600 is not divisible by micro 64 x 8 GPUs"
    failed = [{**r, "status": "failed"} if r.get("name") == "p1-opt" else r for r in ROWS]
    times = step_times(failed, phase_run())
    assert times.boundary_s == 0 and times.micro_s == pytest.approx(1.5 / 32)
    assert times.source == "p1, boundary not separated (inside ms / micro)"


def test_a_noisy_pair_does_not_give_a_negative_time() -> None:
    below = step_times([row("p1", 1.5, 2), row("p1-opt", 0.5, 1)], phase_run())  # 2 x 0.5 - 1.5 < 0
    assert below.boundary_s == 0 and "(measured < 0, taken as 0)" in below.source
    above = step_times([row("p1", 1.5, 2), row("p1-opt", 2.0, 1)], phase_run())  # boundary 2.5 s > the row's step
    assert above.boundary_s == 0 and above.micro_s == pytest.approx(0.75) and "not separated" in above.source


def test_the_table_is_labelled_an_estimate_with_its_assumptions() -> None:
    text = estimate_markdown(estimate([phase_run()], ROWS, [8, 256], NET), NET, "CAVEAT")
    assert text.startswith("### ESTIMATE (not measured)")
    for words in ("A = batch / (micro x GPUs)", "400 GB/s within a node of 8 GPUs", "50 GB/s per GPU across nodes",
                  "No measured multi-GPU efficiency", "CAVEAT", "- rows used, bert_large_64k phase1: p1"):
        assert words in text
    (eight,) = [line for line in text.splitlines() if line.startswith("| bert_large_64k | phase1 | 8 |")]
    assert eight.split("|")[4].strip() == "128" and " h " in eight.split("|")[10]


def test_comparisons_are_ratios_of_rows_present() -> None:
    assert comparisons(ROWS) == ["throughput timer on / off, time per optimizer step: 2.000 (p1-timer-on vs p1)"]


def test_rows_run_at_the_recipes_micro_batches_most_important_first() -> None:
    # the rows no recipe runs (timer on, micro-batches 256 / 64) only with --comparisons or named in --rows
    plain = build_plan(parse_args([]))
    assert not {"p1-timer-on", "p1-big", "p2-big"} & set(row_names(plain))
    assert row_names(build_plan(parse_args(["--rows", "p1-big,p1"]))) == ["p1", "p1-big"]
    stages = build_plan(parse_args(["--comparisons"]))
    assert [s for s in stages if s not in plain] == [s for s in stages if getattr(s, "part", "").endswith(
        ("-timer-on", "-big"))]
    groups = [s for s in stages if s not in (LAMB_STAGE, SELFTEST_STAGE)]
    shapes = [(g.rows[0].name, g.preset, g.seq_len, g.micro_batch, g.tput_timer) for g in groups]
    assert shapes == [("p1", "bert-large", 128, 64, False), ("p2", "bert-large", 512, 16, False),
                      ("p1-timer-on", "bert-large", 128, 64, True), ("p1-big", "bert-large", 128, 256, False),
                      ("p2-big", "bert-large", 512, 64, False), ("bert_base:p1", "bert-base", 128, 128, False),
                      ("bert_base:p2", "bert-base", 512, 32, False)]
    assert row_names(stages)[:10] == ["selftest", "p1", "p1-padded", "p1-full", "p1-opt", "p2", "p2-padded",
                                      "p2-packed", "p2-opt", "lamb"]
    assert [r.unpadded for g in groups[:2] for r in g.rows] == [True, False, False, True] * 2  # the recipe's own path
    for group in groups:  # the one-micro-batch row last: DeepSpeed's boundary count stays aligned
        assert 1 not in [r.accumulation for r in group.rows][:-1]
    assert {r.accumulation for g in groups[:2] for r in g.rows} == {32, 1}
    assert groups[3].rows[0].accumulation == 8  # 256 x 8 = the sequences of p1's 64 x 32
    base = load_config(REPO_ROOT / "ds_configs" / "recipes" / "bert_base.json")  # auto: unpadded on the GPU checked
    assert base.model.attention == "auto" and "bert_base:p2-packed" not in row_names(stages)
    assert all(r.unpadded for g in groups[-2:] for r in g.rows)
    older = build_plan(parse_args([]), OLDER_GPU)  # a V100: auto runs padded rows there, so the check measures those
    assert not any(r.unpadded for s in older if s not in (LAMB_STAGE, SELFTEST_STAGE) for r in s.rows)
    assert "p2-varied" in row_names(older) and "p1-padded" not in row_names(older)


def test_rows_selects_and_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    stages = build_plan(parse_args(["--rows", "p2-packed,lamb"]))
    assert row_names(stages) == ["p2-packed", "lamb"]
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--rows", "p1,p9"])
    assert stopped.value.code == 2 and "--rows: unknown p9" in capsys.readouterr().err


def test_estimate_only_reads_saved_rows_with_other_assumptions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.gpu_check import run as gpu_check

    saved = tmp_path / "rows.jsonl"
    saved.write_text("".join(json.dumps({**r, "unpadded": r["kind"] == "train"}) + "\n" for r in ROWS))
    recipe = REPO_ROOT / "ds_configs" / "recipes" / "bert_large_64k.json"
    assert gpu_check.main(["--estimate-only", str(saved), "--estimate-recipes", str(recipe),
                           "--estimate-gpus", "8", "--intra-node-busbw", "100"]) == 0
    printed = capsys.readouterr().out
    assert "100 GB/s within a node" in printed and f"From the rows of {saved}." in printed
    (phase1,) = [line for line in printed.splitlines() if line.startswith("| bert_large_64k | phase1 | 8 | 128 |")]
    assert "| bert_large_64k | phase2 | 8 | no unpadded row of bert-large at seq 512 x micro 16 |" in printed
    assert gpu_check.main(["--estimate-only", str(tmp_path / "absent.jsonl")]) == 2
