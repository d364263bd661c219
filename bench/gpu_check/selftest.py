"""The kernel self-test's verdict table: what `model.attention=auto` will run on this device, and why.

The first rows of the check (`--rows selftest` runs them alone: the first command on a new cluster). For each
precision the device computes in (CUDA: bf16 where it has it, and fp16; CPU: fp32 and bf16) and each head size
and sequence length of the recipes, the driver's own pieces: the device's facts (pretrain/model/kernel_support.py)
and, where the unpadded kernel can run, the self-tests a run does before training (pretrain/device_check/settle.py
`settle_attention`):

- the kernel self-test (pretrain/device_check/unpadded_check.py): its kernel stage (the kernel alone against the fp32
  reference, limit from the dtype's rounding: the column the first GPU run should be read for, printed with its
  margin, limit / error, because "how far below the limit a correct kernel sits" is what says whether the limit
  is right for flash on that GPU; a dropout smoke check) and its whole-model stage;
- the compiled layer's self-test (pretrain/device_check/compiled_check.py), because the kernel self-test runs the layer
  eager and a compiled run's first execution of inductor's code would otherwise be the run itself. It runs where
  the recipe's plan compiles the layer (`compile_enabled`: model.compile=null compiles on CUDA below ZeRO-3), after
  the kernel passed, once per precision and head size at the longest seq of the phases that compile (what
  `settle_attention` tests), in a child process on CUDA (pretrain/device_check/contained.py, as the run does: a fault in
  generated code cannot poison the check's own CUDA context). On CPU a run compiles nothing and inductor costs
  tens of seconds on 2 cores, so it is skipped unless `--compiled-selftest` asks.

Both self-tests run contained on CUDA: each in its own child process (pretrain/device_check/contained.py), waited for at
most the self-test part's time left (bench/gpu_check/budget.py). The kernel test is the check's first flash call:
in the check's own process, a sticky CUDA error there (an illegal memory access) would fail every row after it;
in a child it is one FAIL row ("child process: its process died of SIGSEGV ...") and the check goes on.

Both run at the shapes a run tests (`case_shape`: the first recipe with the row's head size, its model and its
phase with the most instances per micro-batch), as `settle_attention` passes them.

The precisions are those the recipes run on the device (`selftest_precisions`: bf16 alone on an H100 or H200, as
every shipped recipe has run.precision=auto); fp16 there is skipped, counted in the file ("skipped" record), and
`--selftest-precisions bf16,fp16` runs it.

Cost on one H200 (estimated, not measured): per kernel row, a child process (an interpreter and torch's import,
~5-10 s) and seconds of tests: two rows (head 64, seq 128 and 512, bf16); the compiled check, a child and one
inductor compile of the run's layer (~20-40 s cold, less with TORCHINDUCTOR_CACHE_DIR warm): ~40-75 s in all,
budget 120 s (a child still running at the part's end is killed: "no verdict in N s", a FAIL row).

A FAIL counts as a failed row (exit 1): of the kernel, `auto` would run padded there and an explicit
`model.attention=unpadded` would be refused; of the compiled layer (wrong numbers, an error, or a fallback to
eager), a run would train with eager layers and `model.compile=true` would be refused.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.gpu_check.budget import alarm_deferred
from bench.gpu_check.plan import shape_of
from pretrain.config.attention import compile_enabled, zero_stage
from pretrain.config.deepspeed import effective_precision, phase_ds_json
from pretrain.config.load import load_config
from pretrain.device_check.compiled_check import compiled_self_test
from pretrain.device_check.contained import CHILD_LIMIT_S, SelfTest, in_child
from pretrain.device_check.run_shape import RunShape, micro_batch_lengths
from pretrain.device_check.unpadded_check import kernel_self_test
from pretrain.device_check.verdict import SelfTestResult, over
from pretrain.model.bert import bert_config
from pretrain.model.kernel_support import DeviceFacts, unpadded_kernel, unpadded_problem
from pretrain.model.presets import PRESETS

CHILD_ENDED = re.compile(r"process (died of|exited with)|^no verdict in")  # contained.py's words for a child's end
SELFTEST_HEADER = ("| self-test | device | precision | head | seq | kernel | kernel error (part; limit; margin) "
                   "| logits error (limit) | gradients error (limit) | compiled layer: logits, gradients error (limit) "
                   "| s | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


@dataclass(frozen=True)
class SelftestCase:
    """One row. `compiled_skip`: why the compiled layer's self-test does not run on this row (None: it runs)."""

    precision: str
    head: int
    seq: int
    compiled_skip: str | None = None
    # the run's shapes the tests check (pretrain/device_check/run_shape.py; None: the tests' own), `case_shape`
    shape: RunShape | None = field(default=None, compare=False)


def compile_skip(args: argparse.Namespace, recipe: Path, phase: str, facts: DeviceFacts) -> str | None:
    """Why a run of `recipe`'s `phase` would not compile its layer on this device (None: it would), decided by the
    driver's own `compile_enabled`; `--compiled-selftest` runs the check regardless."""
    if args.compiled_selftest:
        return None
    overrides = [f"--{phase}.ds_config={args.ds_config.resolve()}"] if args.ds_config is not None else []
    config = load_config(recipe, overrides)
    ds = phase_ds_json(config, phase)
    if compile_enabled(config, facts.device_type, ds, unpadded=True):
        return None
    if facts.device_type != "cuda" and config.model.compile is None:
        return f"skipped: a run on {facts.device_type} compiles no layers (--compiled-selftest runs it)"
    setting = {None: "null", True: "true", False: "false"}[config.model.compile]
    return f"skipped: {recipe.stem} {phase} compiles no layers (model.compile={setting}, ZeRO-{zero_stage(ds)})"


@dataclass(frozen=True)
class SelfTests:
    """The two self-tests a row runs (the tests' seams: planted faults) and where: in a child process on CUDA (a
    sticky CUDA error there ends the child, not the check's own context: the rows after it still run), and on
    CPU too with `contain` (--contain-selftest: how the tests reach the child's paths without a GPU)."""

    kernel: SelfTest = kernel_self_test
    compiled: SelfTest = compiled_self_test
    contain: bool = False

    def run(self, test: SelfTest, device: torch.device, case: SelftestCase, limit_s: float) -> SelfTestResult:
        """`test` at `case`, contained where the settings say: pretrain/device_check/contained.py's child, waited for at
        most `limit_s` (its part's time left), killed then; its end (a signal, a status) is then a failed verdict."""
        if device.type != "cuda" and not self.contain:
            return test(device, case.precision, case.head, case.seq, case.shape)
        with alarm_deferred():  # the child's own limit bounds it; a stop mid-wait would leave it running
            return in_child(test, device, case.precision, case.head, case.seq, case.shape,
                            where=f"{device} {case.precision}", limit_s=limit_s)


def selftest_precisions(args: argparse.Namespace, facts: DeviceFacts) -> tuple[list[str], list[str]]:
    """(the precisions the table tests, those it skips). On CUDA: what the recipes run there (run.precision,
    `auto` = bf16 where the GPU has it, else fp16), or --selftest-precisions; the device's other precision is
    skipped (an fp16 row on an H100 costs a compiled check no shipped recipe uses). On CPU: fp32, the CPU's own,
    and bf16, the GPU's (the smoke check's stand-in)."""
    if facts.device_type != "cuda":
        device = ["fp32", "bf16"]
        chosen = args.selftest_precisions or device
    else:
        device = ["bf16", "fp16"] if facts.bf16 else ["fp16"]
        recipes = [args.recipe, *args.also_recipes]
        chosen = args.selftest_precisions or sorted(
            {effective_precision(load_config(Path(recipe)).run.precision, "cuda", facts.bf16) for recipe in recipes},
            key=lambda p: device.index(p) if p in device else len(device))
    return list(chosen), [p for p in device if p not in chosen]


def selftest_cases(args: argparse.Namespace, facts: DeviceFacts) -> list[SelftestCase]:
    """Every row: the precisions to test (`selftest_precisions`) x the recipes' (head size, seq_len); the compiled
    layer's check on the longest seq per head size among the phases that compile (one compile per precision and
    head size)."""
    precisions, _ = selftest_precisions(args, facts)
    skips: dict[tuple[int, int], list[str | None]] = {}  # (head, seq) -> each phase's compile_skip
    for recipe in [args.recipe, *args.also_recipes]:
        for phase in ("phase1", "phase2"):
            preset, seq, _ = shape_of(args, Path(recipe), phase)
            head = PRESETS[preset]["hidden_size"] // PRESETS[preset]["num_attention_heads"]
            skips.setdefault((head, seq), []).append(compile_skip(args, Path(recipe), phase, facts))
    compiled_at: dict[int, int] = {}  # head -> the seq its compiled check runs at
    for (head, seq), reasons in skips.items():
        if None in reasons:
            compiled_at[head] = max(seq, compiled_at.get(head, seq))
    cases = []
    for (head, seq), reasons in sorted(skips.items()):
        if compiled_at.get(head) == seq:
            skip = None
        elif head in compiled_at:
            skip = f"at seq {compiled_at[head]} (one compile per precision)"
        else:
            skip = next(reason for reason in reasons if reason is not None)
        shape = case_shape(args, head)
        cases += [SelftestCase(precision, head, seq, skip, shape) for precision in precisions]
    return sorted(cases, key=lambda case: precisions.index(case.precision))


def case_shape(args: argparse.Namespace, head: int) -> RunShape | None:
    """The shapes a run tests at (pretrain/device_check/settle.py `tested_shape`: its model, and the micro-batch of its
    phase with the most instances), of the first recipe with this head size (--recipe first: BERT-Large, 16 heads,
    64 instances at seq 128 by default), so that the table checks the kernel and the compiled layer as that run
    will; None where no recipe has the head size."""
    for recipe in [Path(args.recipe), *map(Path, args.also_recipes)]:
        phases = [shape_of(args, recipe, phase) for phase in ("phase1", "phase2")]
        ours = [(micro, seq, preset) for preset, seq, micro in phases if head_of(preset) == head]
        if ours:
            micro, seq, preset = max(ours)
            overrides = {key: value for key, value in load_config(recipe).model.overrides.items()
                         if key not in ("vocab_size", "max_position_embeddings")}
            model = bert_config(preset, args.vocab, **overrides)
            return RunShape(heads=model.num_attention_heads, hidden=model.hidden_size,
                            intermediate=model.intermediate_size,
                            attention_dropout=float(model.attention_probs_dropout_prob),
                            hidden_dropout=float(model.hidden_dropout_prob), lengths=micro_batch_lengths(seq, micro))
    return None


def head_of(preset: str) -> int:
    return PRESETS[preset]["hidden_size"] // PRESETS[preset]["num_attention_heads"]


def selftest_row(device: torch.device, facts: DeviceFacts, case: SelftestCase, tests: SelfTests = SelfTests(),
                 limit_s: Callable[[], float] = lambda: CHILD_LIMIT_S) -> dict[str, Any]:
    """The row's verdicts; `tests`: the self-tests and where they run; `limit_s`: how long a child may take (the
    row's part's time left, asked when each child starts)."""
    precision, head, seq = case.precision, case.head, case.seq
    row: dict[str, Any] = {"name": f"selftest-{precision}-h{head}-s{seq}", "device": str(device),
                           "precision": precision, "head_dim": head, "seq_len": seq, "kernel": unpadded_kernel(facts)}
    problem = unpadded_problem(facts, precision, head)
    if problem is not None:
        return {**row, "verdict": "padded", "reason": problem}
    result = tests.run(tests.kernel, device, case, limit_s())
    row.update({"kernel_passed": result.passed, "kernel_error": result.kernel_error,
                "kernel_limit": result.kernel_limit, "kernel_margin": json_margin(result.kernel_error,
                                                                                  result.kernel_limit),
                "kernel_part": result.kernel_part, "logits_error": result.logits_error,
                "logits_limit": result.logits_limit, "grads_error": result.grads_error,
                "grads_limit": result.grads_limit, "seconds": result.seconds, "failure": result.failure,
                "problem": result.problem})
    compiled = compiled_fields(device, case, result.passed, tests, limit_s)
    passed = result.passed and compiled["compiled_verdict"] != "FAIL"
    return {**row, **compiled, "verdict": "PASS" if passed else "FAIL"}


def compiled_fields(device: torch.device, case: SelftestCase, kernel_passed: bool, tests: SelfTests,
                    limit_s: Callable[[], float]) -> dict[str, Any]:
    """The compiled layer's verdict and numbers (`compiled_verdict` None: not run, `compiled_skip` says why)."""
    if case.compiled_skip is not None:
        return {"compiled_verdict": None, "compiled_skip": case.compiled_skip}
    if not kernel_passed:  # settle_attention tests the compiled layer only after the kernel passed
        return {"compiled_verdict": None, "compiled_skip": "not run: the kernel failed (a run compiles nothing then)"}
    result: SelfTestResult = tests.run(tests.compiled, device, case, limit_s())
    return {"compiled_verdict": "PASS" if result.passed else "FAIL", "compiled_skip": None,
            "compiled_logits_error": result.logits_error, "compiled_logits_limit": result.logits_limit,
            "compiled_grads_error": result.grads_error, "compiled_grads_limit": result.grads_limit,
            "compiled_seconds": result.seconds, "compiled_failure": result.failure,
            "compiled_problem": result.problem}


def margin(error: float, limit: float) -> float:
    """limit / error: how far below its limit an error sits (< 1: over it; inf: no error; 0: NaN)."""
    return 1.0 / over(error, limit) if error != 0 else math.inf


def json_margin(error: float, limit: float) -> float | None:
    """The margin for the JSON line (None: no error at all; JSON has no infinity)."""
    value = margin(error, limit)
    return None if math.isinf(value) else value


def margin_words(value: float) -> str:
    if math.isinf(value):
        return "exact"
    return f"{value:.1f}x margin" if value < 10 else f"{value:.0f}x margin"


def failure_words(failure: str) -> str:
    """A failed test's one line: what it raised, or how its child process ended (contained.py words it for a
    rank; here the context kept safe is the check's)."""
    if CHILD_ENDED.search(failure):
        return cell("child process: " + failure.replace("the rank's own context", "the check's own context"))
    return f"raised: {cell(failure)}"


def cell(text: str) -> str:
    """Free text (an error's line) inside a markdown cell."""
    return text.replace("|", "\\|")


def compiled_cell(r: dict[str, Any]) -> str:
    if r.get("compiled_verdict") is None:
        return cell(r.get("compiled_skip") or "")
    if r["compiled_failure"] is not None:
        return f"FAIL: {failure_words(r['compiled_failure'])}"
    if r["compiled_problem"]:
        return f"FAIL: {cell(r['compiled_problem'])}"
    tightest = min(margin(r["compiled_logits_error"], r["compiled_logits_limit"]),
                   margin(r["compiled_grads_error"], r["compiled_grads_limit"]))
    return (f"{r['compiled_logits_error']:.1e} ({r['compiled_logits_limit']:.1e}), {r['compiled_grads_error']:.1e} "
            f"({r['compiled_grads_limit']:.1e}); {margin_words(tightest)}; {r['compiled_seconds']:.1f} s: "
            f"{r['compiled_verdict']}")


def outcome(r: dict[str, Any]) -> str:
    """What a run on this device does with the row's verdicts."""
    if not r["kernel_passed"]:
        words = "FAIL (auto runs padded)"
    elif r.get("compiled_verdict") == "FAIL":
        words = "FAIL (compiled layer: a run's layers run eager, model.compile=true is refused)"
    elif r.get("compiled_verdict") == "PASS":
        words = "PASS (auto runs unpadded; the compiled layer passed)"
    else:
        words = "PASS (auto runs unpadded)"
    return f"{words}: {cell(r['problem'])}" if r.get("problem") else words


def selftest_markdown(r: dict[str, Any]) -> str:
    start = f"| {r['name']} | {r.get('device', '')} | {r.get('precision', '')} | {r.get('head_dim', '')} | " \
            f"{r.get('seq_len', '')} |"
    if r["status"] != "ok":
        return f"{start} {r['status']}: {cell(r['reason'])} |"
    if r["verdict"] == "padded":
        return f"{start} none: {r['reason']} | | | | | | padded (auto runs padded SDPA) |"
    if r["failure"] is not None:
        return (f"{start} {r['kernel']} | {failure_words(r['failure'])} | | | {compiled_cell(r)} | "
                f"{r['seconds']:.1f} | FAIL |")
    kernel = (f"{r['kernel_error']:.1e} ({r['kernel_part']}; {r['kernel_limit']:.1e}; "
              f"{margin_words(margin(r['kernel_error'], r['kernel_limit']))})")
    return (f"{start} {r['kernel']} | {kernel} | {r['logits_error']:.1e} ({r['logits_limit']:.1e}) | "
            f"{r['grads_error']:.1e} ({r['grads_limit']:.1e}) | {compiled_cell(r)} | {r['seconds']:.1f} | "
            f"{outcome(r)} |")
