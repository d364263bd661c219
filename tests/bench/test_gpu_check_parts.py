"""bench/gpu_check's parts on CPU: the kernel self-test contained in a child process (a planted SIGSEGV there is
one FAIL row and the check goes on to its next part), the precisions no recipe runs skipped and counted, the part
time budgets (SIGALRM stops a part that overruns, its rows saved as "stopped", the next part runs; the default
budgets fit gpu_check.sh's limit), and the file naming device MFU and model MFU apart."""

from __future__ import annotations

import json
import math
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.gpu_check.args import OLDER_GPU, parse_args
from bench.gpu_check.budget import CHILD_MARGIN_S, LIMIT_S, PartClock, budget_of, fits_limit
from bench.gpu_check.plan import TARGET_GPU, build_plan, part_names, skipped_comparisons
from bench.gpu_check.selftest import selftest_cases, selftest_precisions
from pretrain.model.kernel_support import DeviceFacts
from tests.bench import gpu_check_plants
from tests.support.pretrain_fixtures import REPO_ROOT

ONE_SHAPE = ["--phase1", "64:4", "--phase2", "64:4"]  # one self-test row per precision


def run_check(tmp_path: Path, flags: list[str], kernel_test: Callable[..., Any]) -> tuple[int, list[dict[str, Any]]]:
    """`--smoke` in this process with `kernel_test` as the verdict table's kernel self-test."""
    from bench.gpu_check import run as gpu_check

    out = tmp_path / "rows.jsonl"
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = gpu_check.main(["--smoke", "--jsonl", str(out), "--work-dir", str(tmp_path / "work"), *flags],
                              kernel_test=kernel_test)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code, [json.loads(line) for line in out.read_text().splitlines()]


def test_a_kernel_test_dying_in_its_child_is_one_fail_row_and_the_check_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the kernel test ran in the check's own process (a device fault there poisons every later row; this
    # plant would end the check itself). Now a child, as on CUDA: one FAIL row, and the LAMB part still measured.
    # (One child: a spawn costs seconds on CPU; a real verdict through the child is tests/device_check/test_contained.py's.)
    code, records = run_check(tmp_path, ["--rows", "selftest,lamb", "--contain-selftest", "--selftest-precisions",
                                         "bf16", *ONE_SHAPE], gpu_check_plants.segfault_in_bf16)
    printed = capsys.readouterr().out
    assert code == 1, printed[-3000:]
    (crashed,) = [r for r in records if r["kind"] == "selftest"]
    assert (crashed["status"], crashed["verdict"], crashed["kernel_passed"]) == ("ok", "FAIL", False), crashed
    assert "process died of SIGSEGV" in crashed["failure"], crashed["failure"]
    assert crashed["compiled_skip"] is not None  # nothing compiled after a failed kernel
    (line,) = [line for line in printed.splitlines() if line.startswith("| selftest-bf16-h32-s64 |")]
    (cell,) = [cell.strip() for cell in line.split("|") if "SIGSEGV" in cell]  # the kernel's cell, one line
    assert cell.startswith("child process: ") and "the rank" not in cell and line.endswith("| FAIL |"), line
    reference = next(r for r in records if r["kind"] == "lamb" and r["variant"] == "reference")
    assert reference["status"] == "ok" and reference["step_ms"] > 0  # the check went on
    end = records[-1]
    assert (end["kind"], end["failed"], end["not_run"], end["stopped"]) == ("end", 1, 1, 0)  # fp32 not run


def test_a_part_over_its_budget_is_stopped_said_in_the_file_and_the_next_part_runs(tmp_path: Path) -> None:
    started = time.monotonic()
    code, records = run_check(tmp_path, ["--rows", "selftest,lamb", "--selftest-precisions", "fp32",
                                         "--part-budget", "selftest=0.3", *ONE_SHAPE], gpu_check_plants.hangs)
    assert time.monotonic() - started < 120  # the plant sleeps 600 s: the budget stopped it
    assert code == 0  # a stop is said, not a failure of the device
    (row,) = [r for r in records if r["kind"] == "selftest"]
    assert row["status"] == "stopped" and row["reason"] == ("part selftest ran over its 0.3 s time budget "
                                                            "(--part-budget)"), row
    parts = {r["part"]: r for r in records if r["kind"] == "part"}
    assert parts["selftest"]["overran"] and parts["selftest"]["budget_s"] == 0.3
    assert parts["lamb"] == {**parts["lamb"], "overran": False, "budget_s": None}  # --smoke: only the part named
    assert next(r for r in records if r["kind"] == "lamb")["status"] == "ok"
    # bf16 is the CPU's other precision: not run, counted in the file with how to run it
    (skipped,) = [r for r in records if r["kind"] == "skipped"]
    assert skipped["count"] == 1 and "--selftest-precisions fp32,bf16" in skipped["reason"]
    assert not any(r.get("precision") == "bf16" for r in records if r["kind"] == "selftest")
    end = records[-1]
    assert (end["stopped"], end["overran"], end["failed"], end["not_run"]) == (1, ["selftest"], 0, 1)


def test_a_childs_wait_ends_before_its_part_and_budgets_parse() -> None:
    clock = PartClock("selftest", 90.0)
    assert 90 - CHILD_MARGIN_S - 1 < clock.child_limit_s(600.0) <= 90 - CHILD_MARGIN_S
    assert clock.child_limit_s(30.0) == 30.0 and PartClock("x", math.inf).child_limit_s(600.0) == 600.0
    assert PartClock("x", 2.0).child_limit_s(600.0) == 1.0  # at least a second
    args = parse_args(["--part-budget", "p1=200,*=40"])
    assert budget_of("p1", args.part_budget) == 200 and budget_of("bert_base:p2", args.part_budget) == 40
    assert budget_of("p2", args.part_budget) == 75  # the default
    assert parse_args(["--part-budget", "none"]).part_budget is None
    assert parse_args(["--smoke"]).part_budget is None  # CPU times are not an H100's
    for bad in ("p1=fast", "p1=0"):
        with pytest.raises(SystemExit):
            parse_args(["--part-budget", bad])


def test_the_default_budgets_fit_gpu_check_sh_limit_on_the_gpus_it_is_for() -> None:
    script = (REPO_ROOT / "bench" / "gpu_check" / "gpu_check.sh").read_text()
    (limit,) = re.findall(r"^  limit=(\d+)  # 9.5 minutes", script, flags=re.MULTILINE)
    assert float(limit) == LIMIT_S
    args = parse_args([])
    for facts in (TARGET_GPU, OLDER_GPU):
        parts = part_names(build_plan(args, facts))
        assert parts == ["selftest", "p1", "p2", "lamb", "bert_base:p1", "bert_base:p2"]
        assert fits_limit(parts, args.part_budget) <= LIMIT_S, parts
    # the rows no recipe runs are left out, counted (bench/gpu_check/run.py saves a "skipped" record)
    assert skipped_comparisons(args) == ["p1-timer-on", "p1-big", "p2-big"]
    assert skipped_comparisons(parse_args(["--comparisons"])) == skipped_comparisons(parse_args(["--rows", "p1"])) == []


def test_the_self_test_runs_the_precisions_the_recipes_run_there() -> None:
    args = parse_args([])  # bert_large_64k and bert_base: run.precision=auto
    assert selftest_precisions(args, TARGET_GPU) == (["bf16"], ["fp16"])
    assert selftest_precisions(args, DeviceFacts("cuda", (7, 0), flash_built=True)) == (["fp16"], [])
    asked = parse_args(["--selftest-precisions", "bf16,fp16"])
    assert selftest_precisions(asked, TARGET_GPU) == (["bf16", "fp16"], [])
    assert selftest_precisions(parse_args(["--smoke"]), DeviceFacts("cpu")) == (["fp32", "bf16"], [])
    with pytest.raises(SystemExit):
        parse_args(["--selftest-precisions", "fp8"])


def test_the_self_tests_run_at_the_shapes_the_recipes_run_will_test() -> None:
    # as pretrain/device_check/settle.py's tested_shape: the recipe's model and its phase with the most instances (the
    # most segments), here BERT-Large's 16 heads at 64 x 128, not the tests' own 2 heads and 7 segments
    cases = selftest_cases(parse_args([]), TARGET_GPU)
    assert [(case.precision, case.head, case.seq) for case in cases] == [("bf16", 64, 128), ("bf16", 64, 512)]
    for case in cases:
        assert case.shape is not None and (case.shape.heads, case.shape.hidden) == (16, 1024)
        assert len(case.shape.lengths) == 64 and max(case.shape.lengths) <= 128
        assert case.shape.attention_dropout == 0.1


def test_the_file_and_the_table_name_device_mfu_and_model_mfu_apart() -> None:
    from bench.gpu_check.report import COLUMNS, TRAIN_HEADER

    header = TRAIN_HEADER.splitlines()[0]
    assert "| device MFU (padding incl.) | model MFU (real tokens: a run's perf/mfu) |" in header
    assert "| MFU |" not in header
    assert set(COLUMNS) == {"device_tflops", "device_mfu", "model_mfu"}
    assert "perf/mfu" in COLUMNS["model_mfu"] and "perf/device_mfu" in COLUMNS["device_mfu"]
