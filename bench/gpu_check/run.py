"""One prepared GPU check: the kernel self-test's verdict table (what model.attention=auto runs on this device
and why; the kernel's margin under its limit; the compiled layer's self-test where a run compiles), the
production training step of the shipped recipe at its own micro-batches (with the compiled layer's graphs and
recompiles), the LAMB step against its memory-traffic floor, peak memory, and from them an ESTIMATE of each
shipped recipe's phase wall-clock on 8, 64 and 256 GPUs. Run through bench/gpu_check/gpu_check.sh
(docs/performance.md); `--rows selftest` prints the verdict table alone, in about a minute on a GPU (seconds on
CPU). The check runs in parts (the self-test table, each engine's rows, the LAMB rows), each under its own time
budget (bench/gpu_check/budget.py): a part that overruns is stopped, its rows saved as "stopped", and the next
part runs.

    python -m bench.gpu_check [--smoke] [--recipe RUN.json] [--rows p1,p2,...] [--jsonl OUT.jsonl]
                              [--deadline T] [any flag below]

Every row is saved and printed the moment it is measured: one JSON line appended (and fsynced) to
--jsonl (default ./gpu_check.jsonl; records "run", "selftest", "train", "attention", "lamb", "part", "skipped",
"estimate", "end", all with the run's start time as "run"), then its markdown row on stdout (table headers first). A crash, a timeout
(SIGTERM: the estimate from the rows so far and an "end" record are saved, exit 124) or a failing row
keeps every row measured before it; a row that raises is printed as "failed: <reason>" and the check
goes on with the next one (exit 1 at the end).

Training rows (bench/gpu_check/plan.py lists them, most important first): the recipe's phase 1 and
phase 2 at its micro-batch sizes, through `pretrain.trainer.PhaseTrainer.train_step` with A
micro-batches per optimizer step (--accum1 / --accum2), real `RankBatches` over synthetic shards whose
lengths are like real data (10 % short instances: the attention mask and SDPA's masked kernel run) and
the recipe's DataLoader workers (bench/gpu_check/train.py); the engine is what the driver builds for the
phase (`plan_run`, `build_engine`: bf16 + ZeRO-1 + fp32 grad accumulation = BF16_Optimizer around our
ExactLamb, clipping 1.0), with DeepSpeed's throughput timer set explicitly (off, as the shipped JSON is
meant to have it; one row has it on). Each row also runs the same engine with one micro-batch per step,
which separates the optimizer boundary's time; plus no-padding, packed and the previous check's
micro-batch 256 / 64 rows, and BERT-base at bert_base.json's micro-batches. Each row records the
wrapper the engine has, the precision, which LAMB step ran, peak memory (reset per row; n/a on CPU).

LAMB rows: one step over BERT-Large's parameters as ZeRO-1 flat fp32 partitions (one rank holds all):
the reference multi-tensor step, then the fused compiled step, against the floor of ~40 bytes per
parameter at the copy bandwidth measured in this process. A fused step that fails to compile is
printed as "fused: failed: <reason>"; the reference row stands.

--smoke: CPU (DS_ACCELERATOR=cpu), the tiny model at tiny shapes, 2 micro-batches per step, the same
bf16 + BF16_Optimizer engine and trainer; the fused LAMB row only with --fused-on-cpu.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from deepspeed.utils import logger as ds_logger  # noqa: E402

from bench.gpu_check.args import parse_args  # noqa: E402
from bench.gpu_check.attention import ATTENTION_HEADER, attention_markdown, attention_row  # noqa: E402
from bench.gpu_check.budget import PartOverrun, alarm_deferred, budget_of, no_part, part_clock  # noqa: E402
from bench.gpu_check.estimate import comparisons, estimate, estimate_markdown  # noqa: E402
from bench.gpu_check.plan import LAMB_STAGE, SELFTEST_STAGE, GroupSpec, build_plan, skipped_comparisons  # noqa: E402
from bench.gpu_check.preflight import loaded_distributions  # noqa: E402
from bench.gpu_check.recorder import Recorder, measure, one_line  # noqa: E402
from bench.gpu_check.report import (  # noqa: E402
    COLUMNS,
    LAMB_HEADER,
    TRAIN_HEADER,
    estimate_runs,
    lamb_markdown,
    train_markdown,
)
from bench.gpu_check.rows import lamb_floor_ms, lamb_row, lamb_shapes  # noqa: E402
from bench.gpu_check.selftest import (  # noqa: E402
    SELFTEST_HEADER,
    SelfTests,
    selftest_cases,
    selftest_markdown,
    selftest_precisions,
    selftest_row,
)
from bench.gpu_check.shards import ShardCache  # noqa: E402
from bench.gpu_check.train import build_group, group_key, train_row  # noqa: E402
from pretrain.device_check.compiled_check import compiled_self_test  # noqa: E402
from pretrain.device_check.contained import CHILD_LIMIT_S, SelfTest  # noqa: E402
from pretrain.device_check.unpadded_check import kernel_self_test  # noqa: E402
from pretrain.distributed.info import DistInfo  # noqa: E402
from pretrain.distributed.process_group import init_distributed  # noqa: E402
from pretrain.model.compiled import CompileLedger  # noqa: E402
from pretrain.model.kernel_support import read_device_facts  # noqa: E402


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Check:
    """The run: the plan's stages in order, each row saved as measured, the estimate at the end."""

    def __init__(self, args: argparse.Namespace, recorder: Recorder, dist_info: DistInfo,
                 tests: SelfTests) -> None:
        self.args, self.recorder, self.dist_info = args, recorder, dist_info
        self.tests = tests  # the self-tests and where they run (the tests' seam: main's parameters)
        self.clock = no_part()  # the running part's (bench/gpu_check/budget.py)
        # the running part's rows not saved yet: (kind, key, markdown); a stop saves them as "stopped"
        self.pending: list[tuple[str, dict[str, Any], Callable[[dict[str, Any]], str]]] = []
        # one per recipe, as a run has one per process over its phases: phase 2's recompile shows in its rows
        self.ledgers: dict[Path, CompileLedger] = {}
        self.device = dist_info.device
        self.facts = read_device_facts(self.device)  # what model.attention=auto decides by, as in the driver
        self.shards = ShardCache(args.work_dir / "shards", args.vocab, args.shard_instances, args.smoke)
        self.table: str | None = None  # the header printed last

    def left(self) -> float:
        return float("inf") if self.args.deadline is None else self.args.deadline - time.time()

    def header(self, header: str) -> None:
        if self.table != header:
            print(f"\n{header}", flush=True)
            self.table = header

    def skipped(self, key: dict[str, Any], why: str) -> dict[str, Any]:
        return {**key, "status": "skipped", "reason": why}

    def expect(self, kind: str, keys: list[dict[str, Any]], markdown: Callable[[dict[str, Any]], str]) -> None:
        """The rows the running part will save, in order: a stop of the part saves those left as "stopped"."""
        self.pending += [(kind, key, markdown) for key in keys]

    def save(self, kind: str, row: dict[str, Any], markdown: str) -> None:
        """A row of the running part, saved; no longer pending."""
        self.pending = [entry for entry in self.pending if not (entry[0] == kind and entry[1].items() <= row.items())]
        self.recorder.save(kind, row, markdown)

    def part(self, name: str, body: Callable[[], None]) -> None:
        """One part under its time budget: a stop (PartOverrun) saves its unsaved rows as "stopped" with the reason,
        and the check goes on with the next part; the part's time and whether it overran are saved ("part")."""
        budget = budget_of(name, self.args.part_budget)
        self.pending = []
        clock = None
        try:
            with part_clock(name, budget) as clock:
                self.clock = clock
                body()
        except PartOverrun:
            why = f"part {name} ran over its {budget:g} s time budget (--part-budget)"
            print(f"[gpu_check] stopped: {why}", file=sys.stderr, flush=True)
            for kind, key, markdown in self.pending:
                row = {**key, "status": "stopped", "reason": why}
                self.recorder.save(kind, row, markdown(row))
            self.pending = []
            release(self.device)
        if clock is not None:
            self.recorder.save("part", clock.record())
        self.clock = no_part()

    def group(self, group: GroupSpec) -> None:
        self.header(TRAIN_HEADER)
        keys = [group_key(group, row) for row in group.rows]
        self.expect("train", keys, train_markdown)
        if self.left() < self.args.reserve_s:
            for key in keys:
                row = self.skipped(key, f"time budget ({self.left():.0f} s left)")
                self.save("train", row, train_markdown(row))
            return
        print(f"[gpu_check] {group.preset} {group.phase} seq {group.seq_len} micro {group.micro_batch}: "
              f"building the engine ...", file=sys.stderr, flush=True)
        built: Any = None
        try:
            with contextlib.redirect_stdout(sys.stderr):
                ledger = self.ledgers.setdefault(group.recipe, CompileLedger())
                built = build_group(group, self.args, self.shards, self.dist_info, ledger)
        except Exception as error:  # noqa: BLE001 - every row of the group fails with the reason
            print(f"[gpu_check] {group.phase} engine failed:\n{traceback.format_exc()}", file=sys.stderr)
            for key in keys:
                row = {**key, "status": "failed", "reason": one_line(error)}
                self.save("train", row, train_markdown(row))
            release(self.device)
            return
        try:
            for row_spec, key in zip(group.rows, keys, strict=True):
                if self.left() < self.args.reserve_s:
                    row = self.skipped(key, f"time budget ({self.left():.0f} s left)")
                else:
                    print(f"[gpu_check] row {row_spec.name} ...", file=sys.stderr, flush=True)
                    row = measure(key, train_row, built, group, row_spec, self.args, self.shards, self.dist_info)
                release(self.device)
                self.save("train", row, train_markdown(row))
            self.attention(group, built)
        finally:
            with alarm_deferred():
                built.engine.destroy()
                del built
                release(self.device)

    def attention(self, group: GroupSpec, built: Any) -> None:
        """Where the group runs unpadded: the kernel that runs and padded == unpadded (bench/gpu_check/attention.py)."""
        if not group.attention_check or not any(row.unpadded for row in group.rows) or \
                self.left() < self.args.reserve_s / 3:
            return
        key = {"name": f"{group.rows[0].name}-attention", "model": group.preset}
        record = measure(key, attention_row, built.engine.module, group, self.shards, self.device)
        release(self.device)
        self.header(ATTENTION_HEADER)
        self.recorder.save("attention", record, attention_markdown(record))

    def selftest(self) -> None:
        """The kernel self-test's verdict table, with the compiled layer's (bench/gpu_check/selftest.py)."""
        self.header(SELFTEST_HEADER)
        _, skipped = selftest_precisions(self.args, self.facts)
        cases = selftest_cases(self.args, self.facts)
        keys = [{"name": f"selftest-{case.precision}-h{case.head}-s{case.seq}", "precision": case.precision}
                for case in cases]
        if skipped:  # counted in the file: what was not run, and how to run it
            shapes = len({(case.head, case.seq) for case in cases})
            why = (f"no recipe of this check runs {','.join(skipped)} on {self.facts.device_type} "
                   f"(--selftest-precisions {','.join([*selftest_precisions(self.args, self.facts)[0], *skipped])} "
                   "runs them)")
            self.recorder.save("skipped", {"what": f"self-test rows in {','.join(skipped)}",
                                           "count": shapes * len(skipped), "reason": why})
            print(f"[gpu_check] not run: {shapes * len(skipped)} self-test rows: {why}", file=sys.stderr, flush=True)
        self.expect("selftest", keys, selftest_markdown)
        for case, key in zip(cases, keys, strict=True):
            if case.compiled_skip is None and self.left() < self.args.reserve_s:
                case = dataclasses.replace(case, compiled_skip=f"skipped: time budget ({self.left():.0f} s left)")
            row = measure(key, selftest_row, self.device, self.facts, case, self.tests,
                          lambda: self.clock.child_limit_s(CHILD_LIMIT_S))
            self.save("selftest", row, selftest_markdown(row))

    def lamb(self) -> None:
        args = self.args
        self.header(LAMB_HEADER)
        shapes = lamb_shapes(args.lamb_model, args.vocab)
        # None when the bandwidth measurement fails (the rows then have no "x floor")
        keys = [{"model": args.lamb_model, "variant": variant} for variant in ("reference", "fused")]
        self.expect("lamb", keys, lamb_markdown)
        floor_ms = measure({}, lambda: {"floor_ms": lamb_floor_ms(shapes, self.device)}).get("floor_ms")
        for key in keys:
            variant = key["variant"]
            if variant == "fused" and self.device.type == "cpu" and not args.fused_on_cpu:
                row = self.skipped(key, "CPU (--fused-on-cpu times it)")
            elif self.left() < args.reserve_s / 3:
                row = self.skipped(key, "time budget")
            else:
                row = measure(key, lamb_row, args.lamb_model, shapes, variant, floor_ms, args.lamb_reps, self.device)
            release(self.device)
            self.save("lamb", row, lamb_markdown(row))

    def estimate(self, caveat: str = "") -> None:
        """The wall-clock estimate from every row saved so far (a pure function of them), saved and printed."""
        args = self.args
        runs, problems = estimate_runs(args, self.facts)
        table = estimate(runs, self.recorder.records, args.estimate_gpus, args.network)
        if args.smoke:
            caveat = f"SMOKE RUN: the tiny model on CPU at tiny shapes; the figures only show the format. {caveat}"
        self.recorder.save("estimate", {"estimates": table, "problems": problems, "caveat": caveat.strip(),
                                        "network": vars(args.network), "gpus": args.estimate_gpus})
        print("\n" + estimate_markdown(table, args.network, caveat.strip()), flush=True)
        for line in problems:
            print(f"- not estimated: {line}", flush=True)
        ratios = comparisons(self.recorder.records)
        if ratios:
            print("\nRatios between rows of this run (same process):\n" + "\n".join(f"- {r}" for r in ratios),
                  flush=True)

    def run(self) -> None:
        stages = build_plan(self.args, self.facts)
        left_out = skipped_comparisons(self.args, self.facts)
        if left_out:  # counted in the file: what was not run, and how to run it
            why = "no recipe runs them (the shipped JSON's timer is off; other micro-batches): --comparisons runs them"
            self.recorder.save("skipped", {"what": f"rows {','.join(left_out)}", "count": len(left_out), "reason": why})
            print(f"[gpu_check] not run: rows {','.join(left_out)}: {why}", file=sys.stderr, flush=True)
        for stage in stages:
            if stage == SELFTEST_STAGE:
                self.part(SELFTEST_STAGE, self.selftest)
            elif stage == LAMB_STAGE:
                self.part(LAMB_STAGE, self.lamb)
            else:
                assert isinstance(stage, GroupSpec)
                self.part(stage.part, functools.partial(self.group, stage))
        if stages != [SELFTEST_STAGE]:  # `--rows selftest` alone: the verdict table, nothing to estimate from
            self.estimate()


def start(args: argparse.Namespace) -> tuple[DistInfo, str]:
    # DeepSpeed logs (and prints, see `measure`) to stdout; keep stdout for the tables.
    for handler in ds_logger.handlers:
        if getattr(handler, "stream", None) is sys.stdout:
            handler.setStream(sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):
        dist_info = init_distributed()
    # A run compiles its layer for one model (train and eval, two phases: about 4 graphs); the check builds
    # BERT-Large and BERT-base engines at several shapes in one process, whose graphs of the one layer function
    # would reach torch's default limit (8) and run the last rows eager (compile/recompile_limit would say so).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    device = dist_info.device
    return dist_info, torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"


def estimate_only(args: argparse.Namespace) -> int:
    """The estimate from a saved run's rows, with this command line's recipes and network assumptions."""
    try:
        rows = [json.loads(line) for line in args.estimate_only.read_text(encoding="utf-8").splitlines() if line]
    except (OSError, json.JSONDecodeError) as error:
        print(f"gpu_check: --estimate-only {args.estimate_only}: {error}", file=sys.stderr)
        return 2
    runs, problems = estimate_runs(args)
    print(estimate_markdown(estimate(runs, rows, args.estimate_gpus, args.network), args.network,
                            f"From the rows of {args.estimate_only}."))
    for line in [*problems, *comparisons(rows)]:
        print(f"- {line}")
    return 0


def main(argv: list[str] | None = None, compiled_test: SelfTest = compiled_self_test,
         kernel_test: SelfTest = kernel_self_test) -> int:
    """The check; `compiled_test`, `kernel_test`: the verdict table's self-tests (the tests' seams)."""
    started = time.monotonic()
    args = parse_args(argv)
    if args.estimate_only is not None:
        return estimate_only(args)
    own_work_dir = args.work_dir is None
    args.work_dir = Path(tempfile.mkdtemp(prefix="gpu_check_")) if own_work_dir else args.work_dir
    recorder = Recorder(args.jsonl)
    imported = loaded_distributions()
    dist_info, device_name = start(args)
    if dist_info.device.type != "cuda" and not args.smoke:
        print("gpu_check: no CUDA device; use --smoke for the CPU check", file=sys.stderr)
        return 2
    check = Check(args, recorder, dist_info, SelfTests(kernel_test, compiled_test, args.contain_selftest))

    def on_term(signum: int, _frame: object) -> None:  # `timeout` ends the check: keep what was measured
        sys.stdout = sys.__stdout__  # the signal may come while DeepSpeed's prints are sent to stderr
        with contextlib.suppress(Exception):
            check.estimate("Stopped at the time limit: from the rows measured before it.")
        recorder.save("end", {"status": f"killed by signal {signum} (time limit)", "rows": recorder.rows,
                              "seconds": time.monotonic() - started})
        print(f"gpu_check: stopped by signal {signum} after {recorder.rows} rows; they are in {args.jsonl}",
              file=sys.stderr, flush=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    recorder.save("run", {"device": device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
                          "columns": COLUMNS,
                          "args": {k: str(v) for k, v in vars(args).items()}})
    print(f"\n### {device_name}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    check.run()
    loaded = loaded_distributions()
    lazily = {name: version for name, version in loaded.items() if name not in imported}
    recorder.save("end", {"status": "done", "rows": recorder.rows, "failed": recorder.failed,
                          "skipped": recorder.skipped, "stopped": recorder.stopped,
                          "overran": [r["part"] for r in recorder.records if r["kind"] == "part" and r["overran"]],
                          "not_run": sum(r["count"] for r in recorder.records if r["kind"] == "skipped"),
                          "seconds": time.monotonic() - started, "distributions": loaded,
                          "loaded_lazily": lazily})
    if own_work_dir:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    print("gpu_check: wheels loaded during the run, after the imports: "
          + (" ".join(f"{n}=={v}" for n, v in lazily.items()) or "none"), file=sys.stderr)
    print(f"\ngpu_check: {recorder.rows} rows ({recorder.failed} failed, {recorder.skipped} skipped, "
          f"{recorder.stopped} stopped at their part's time budget) in {time.monotonic() - started:.0f} s; "
          f"saved to {args.jsonl}", file=sys.stderr, flush=True)
    return 1 if recorder.failed else 0


if __name__ == "__main__":
    sys.exit(main())
