"""bench/gpu_check's verdict table and compile column on CPU: the kernel's margin under its limit, the compiled
layer's self-test (asked for with --compiled-selftest, run with a backend that generates no code: inductor costs
tens of seconds on 2 cores) passing on the real layer and failing the check on a planted wrong kernel, and the
training rows' compile column from the compiled layer's real counters (graphs, phase 2's recompile, a fallback).
The whole check's smoke run is tests/bench/test_gpu_check.py."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.device_check.compiled_check import compiled_self_test
from pretrain.model.varlen_attention import varlen_attention
from tests.support.attention_plans import across_segments
from tests.support.pretrain_fixtures import REPO_ROOT

CPU = torch.device("cpu")


def run_selftest(tmp_path: Path, name: str, compiled_test: Callable[..., Any],
                 *flags: str) -> tuple[int, list[dict[str, Any]]]:
    """`--smoke --rows selftest --compiled-selftest` in this process, with `compiled_test` as the compiled check."""
    from bench.gpu_check import run as gpu_check

    out = tmp_path / f"{name}.jsonl"
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = gpu_check.main(["--smoke", "--rows", "selftest", "--compiled-selftest", "--jsonl", str(out),
                               "--work-dir", str(tmp_path / name), *flags], compiled_test=compiled_test)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code, [json.loads(line) for line in out.read_text().splitlines()]


def row_line(printed: str, name: str) -> str:
    (line,) = [line for line in printed.splitlines() if line.startswith(f"| {name} |")]
    return line


def test_the_compiled_check_runs_where_the_recipe_compiles_once_per_precision_at_the_longest_seq(
    tmp_path: Path,
) -> None:
    from bench.gpu_check.args import parse_args
    from bench.gpu_check.plan import TARGET_GPU
    from bench.gpu_check.selftest import SelftestCase, selftest_cases
    from pretrain.model.kernel_support import read_device_facts

    cpu = read_device_facts(CPU)
    cases = selftest_cases(parse_args(["--smoke"]), cpu)  # the tiny model at seq 32 and 64, fp32 and bf16
    skip = "skipped: a run on cpu compiles no layers (--compiled-selftest runs it)"
    assert cases == [SelftestCase(p, 32, seq, skip) for p in ("fp32", "bf16") for seq in (32, 64)]
    at_64 = "at seq 64 (one compile per precision)"
    asked = selftest_cases(parse_args(["--smoke", "--compiled-selftest"]), cpu)
    assert asked == [SelftestCase("fp32", 32, 32, at_64), SelftestCase("fp32", 32, 64),
                     SelftestCase("bf16", 32, 32, at_64), SelftestCase("bf16", 32, 64)]
    # an H100's facts: model.compile=null compiles there (ZeRO-1), so the check runs without being asked; in bf16
    # alone, the precision every shipped recipe runs there (run.precision=auto) ...
    assert selftest_cases(parse_args(["--smoke"]), TARGET_GPU) == [
        SelftestCase("bf16", 32, 32, at_64), SelftestCase("bf16", 32, 64)]
    # ... fp16 on asking (the rows, and the compiled check's compile, a recipe there never needs)
    assert selftest_cases(parse_args(["--smoke", "--selftest-precisions", "bf16,fp16"]), TARGET_GPU) == [
        SelftestCase("bf16", 32, 32, at_64), SelftestCase("bf16", 32, 64), SelftestCase("fp16", 32, 32, at_64),
        SelftestCase("fp16", 32, 64)]
    # ... and not under ZeRO-3, whose parameter gathering hooks break the graph (compile_enabled says why)
    shipped = json.loads((REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero1.json").read_text())
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({**shipped, "zero_optimization": {"stage": 3}}))
    cases = selftest_cases(parse_args(["--smoke", "--ds-config", str(zero3)]), TARGET_GPU)
    why = [f"skipped: bert_large_64k {phase} compiles no layers (model.compile=null, ZeRO-3)"
           for phase in ("phase1", "phase2")]  # seq 32, seq 64
    assert [case.compiled_skip for case in cases] == why  # bf16 alone


def wrong_in_bf16(device: torch.device, precision: str, head_dim: int, seq_len: int, shape: Any = None) -> Any:
    """The compiled layer's self-test with no code generation, at the run's shape the check passes; in bf16 its
    layer is given a kernel that ignores the segment bounds (what wrong generated code around the kernel would do),
    in fp32 the device's own."""
    assert shape is not None and shape.heads == 2 and len(shape.lengths) == 4  # the tiny recipe's, micro 4
    kernel = across_segments if precision == "bf16" else varlen_attention
    return compiled_self_test(device, precision, head_dim, seq_len, shape, backend="aot_eager", kernel=kernel)


def test_the_verdict_table_prints_the_margins_and_a_wrong_compiled_layer_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # one shape (seq 64 in both phases), so each precision's row runs the compiled check: fp32's passes, bf16's
    # is planted wrong while its eager kernel stage runs the device's kernel and passes
    torch._dynamo.reset()
    code, records = run_selftest(tmp_path, "check", wrong_in_bf16, "--phase1", "64:4", "--phase2", "64:4")
    printed = capsys.readouterr().out
    assert code == 1, printed[-3000:]
    assert records[-1]["kind"] == "end" and records[-1]["failed"] == 1
    fp32, bf16 = rows = [r for r in records if r["kind"] == "selftest"]
    assert [r["name"] for r in rows] == ["selftest-fp32-h32-s64", "selftest-bf16-h32-s64"]
    header = next(line for line in printed.splitlines() if line.startswith("| self-test |"))
    assert "| kernel error (part; limit; margin) |" in header and "| compiled layer: " in header
    cells = {r["name"]: row_line(printed, r["name"]).split("|")[1:-1] for r in rows}
    assert all(len(row) == header.count("|") - 1 for row in cells.values())  # every row fills the header
    for r in rows:  # the eager kernel passed on both
        assert r["status"] == "ok" and r["kernel_passed"] and r["kernel_error"] <= r["kernel_limit"], r
        assert r["compiled_skip"] is None and r["compiled_failure"] is None and r["compiled_problem"] is None, r
    # fp32: the reference kernel is the reference (no error: "exact"); the compiled layer within its limits
    assert fp32["kernel_error"] == 0 and fp32["kernel_margin"] is None
    assert cells[fp32["name"]][6].strip() == "0.0e+00 (output; 1.0e-05; exact)"
    assert (fp32["compiled_verdict"], fp32["verdict"]) == ("PASS", "PASS")
    assert fp32["compiled_logits_error"] <= fp32["compiled_logits_limit"]
    assert fp32["compiled_grads_error"] <= fp32["compiled_grads_limit"]
    # the compiled layer's check runs one layer against the eager one: on CPU in fp32 the same code, no error at all
    assert cells[fp32["name"]][9].strip() == (
        f"0.0e+00 (1.0e-05), 0.0e+00 (1.0e-05); exact; {fp32['compiled_seconds']:.1f} s: PASS")
    assert cells[fp32["name"]][11].strip() == "PASS (auto runs unpadded; the compiled layer passed)"
    # bf16: the kernel's error against its limit and how far below it; the planted compiled layer far over its own
    assert bf16["kernel_margin"] == pytest.approx(bf16["kernel_limit"] / bf16["kernel_error"])
    assert bf16["kernel_margin"] > 1
    assert cells[bf16["name"]][6].strip() == (f"{bf16['kernel_error']:.1e} ({bf16['kernel_part']}; "
                                              f"{bf16['kernel_limit']:.1e}; {bf16['kernel_margin']:.1f}x margin)")
    assert (bf16["compiled_verdict"], bf16["verdict"]) == ("FAIL", "FAIL")
    assert bf16["compiled_logits_error"] > 2 * bf16["compiled_logits_limit"], bf16
    assert cells[bf16["name"]][9].strip().endswith(f"{bf16['compiled_seconds']:.1f} s: FAIL")
    assert cells[bf16["name"]][11].strip() == ("FAIL (compiled layer: a run's layers run eager, model.compile=true "
                                               "is refused)")


def phase_through(layer: Any, seq_len: int) -> torch.nn.Module:
    """A phase of the self-test's small model (forward and backward on its edge-case micro-batches at `seq_len`)
    through `layer`, returned as the model a row's engine holds: the layer function set as compile_layers sets it."""
    from pretrain.device_check.unpadded_check import compare, small_model
    from pretrain.model.unpadded import LAYER_FORWARD_ATTRIBUTE

    compare(CPU, "fp32", 32, seq_len, layer)
    model = small_model(32, seq_len)
    setattr(model, LAYER_FORWARD_ATTRIBUTE, layer)
    return model


def train_row(**compile_state: Any) -> dict[str, Any]:
    """A measured training row's keys (bench/gpu_check/train.py `train_row`), its numbers made up."""
    return {"name": "p2", "model": "tiny", "seq_len": 64, "micro_batch": 4, "accumulation": 2, "profile": "varied",
            "packing": False, "unpadded": True, "tput_timer": False, "status": "ok", "wrapper": "BF16_Optimizer",
            "lamb_step": "reference", "step_s": 0.5, "micro_ms": 250.0, "inst_per_s": 16.0,
            "real_tokens_per_s": 700.0, "data_wait_ms": 1.0, "device_tflops": 0.01, "device_mfu": None,
            "model_mfu": None,
            "peak_alloc_gb": None, "peak_reserved_gb": None, "fits_80gb": None, **compile_state}


def test_the_training_rows_print_the_compiled_layers_graphs_recompiles_and_fallback() -> None:
    from bench.gpu_check.report import TRAIN_HEADER, train_markdown
    from bench.gpu_check.train import compile_state
    from pretrain.device_check.unpadded_check import small_model
    from pretrain.model.compiled import CompiledLayer, CompileLedger, ignore

    def no_compiler(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
        raise RuntimeError("planted: Cannot find a working triton installation")

    torch._dynamo.reset()
    # two phases of one recipe, each its own model and CompiledLayer, one ledger (as the check keeps per recipe)
    ledger = CompileLedger()
    phase1 = phase_through(CompiledLayer(say=ignore, backend="eager", ledger=ledger), 32)
    after_phase1 = compile_state(phase1)
    phase2 = phase_through(CompiledLayer(say=ignore, backend="eager", ledger=ledger), 64)
    state = compile_state(phase2)
    graphs = state["compile/graphs"]
    assert graphs > after_phase1["compile/graphs"] >= 1  # phase 2's max_seqlen compiled a graph of its own
    assert state["compile/recompiles"] == graphs - 1 and state["compile/fallback"] == 0, state
    assert state["compile_fallback"] is None
    columns = TRAIN_HEADER.splitlines()[0].count("|")
    line = train_markdown(train_row(**state))
    assert line.endswith(f"| graphs {graphs:.0f}, recompiles {graphs - 1:.0f} |") and line.count("|") == columns

    failed = phase_through(CompiledLayer(say=ignore, backend=no_compiler), 32)  # the layer fell back to eager
    state = compile_state(failed)
    assert state["compile/fallback"] == 1 and state["compile_fallback"].startswith("BackendCompilerFailed: ")
    line = train_markdown(train_row(**state))
    assert line.endswith("raised: RuntimeError: planted: Cannot find a working triton installation |"), line
    assert f"| fell back: {state['compile_fallback']} |" in line

    assert compile_state(small_model(32, 32)) == {}  # its layers eager: no compiled layer, no compile/* keys
    assert train_markdown(train_row()).endswith("| n/a | eager |")
    assert train_markdown(train_row(unpadded=False)).endswith("| n/a | n/a (padded rows) |")
