"""Command line of bench/gpu_check/run.py (its docstring and docs/performance.md say what the rows are)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.gpu_check.budget import budget_arg, part_budgets
from bench.gpu_check.estimate import Network
from bench.gpu_check.plan import build_plan, row_names
from bench.gpu_check.preflight import DEFAULT_JSONL, DEFAULT_RECIPE
from pretrain.model.kernel_support import DeviceFacts

RECIPES = DEFAULT_RECIPE.parent
OLDER_GPU = DeviceFacts("cuda", (7, 0), flash_built=True)  # a V100: model.attention=auto runs padded rows
VOCAB = 30522
# The shipped pretraining recipes (codistillation runs two models, tiny_cpu is a CPU demo).
ESTIMATE_RECIPES = ",".join(str(RECIPES / f"{name}.json") for name in ("bert_large_64k", "bert_large_32k", "bert_base"))
# --smoke: every row at tiny shapes, one timed step, one DataLoader worker (the recipe's 4 on 2 CI cores
# would only add start-up time; one still runs the worker-process path).
SMOKE_DEFAULTS = dict(model="tiny", lamb_model="tiny", vocab=512, phase1=(32, 4), phase2=(64, 4),
                      big_phase1=(32, 8), big_phase2=(64, 8), accum1=2, accum2=2, steps=1, boundary_steps=1,
                      warmup=1, lamb_reps=3, shard_instances=64, num_workers=1, also_recipes=[])


def shape_arg(text: str) -> tuple[int, int] | None:
    """SEQ:MICRO, or "none" (skip the row)."""
    if text.lower() == "none":
        return None
    try:
        seq, micro = text.split(":")
        return int(seq), int(micro)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected SEQ:MICRO (e.g. 128:64), got {text!r}") from err


def paths_arg(text: str) -> list[Path]:
    return [Path(p) for p in text.split(",") if p]


def ints_arg(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",") if n]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description="One prepared GPU check (bench/gpu_check/run.py).")
    add = parser.add_argument
    add("--smoke", action="store_true", help="CPU, the tiny model at tiny shapes (CI)")
    add("--recipe", type=Path, default=DEFAULT_RECIPE, help="the run config whose phases the main rows measure")
    add("--also-recipes", type=paths_arg, default=[RECIPES / "bert_base.json"],
        help="comma-separated run configs whose phase 1 and 2 are measured last (their models' rows)")
    add("--rows", type=lambda t: set(t.split(",")), default=None, help="only these rows (names as printed; "
        "'lamb' = the LAMB rows, 'selftest' = the kernel self-test's verdict table alone, in seconds); default all")
    add("--model", default=None, help="the model preset of every row (default: each recipe's)")
    add("--phase1", type=shape_arg, default=None, help="SEQ:MICRO of the phase-1 rows (default: the recipe's)")
    add("--phase2", type=shape_arg, default=None, help="SEQ:MICRO of the phase-2 rows (default: the recipe's)")
    add("--big-phase1", type=shape_arg, default=(128, 256), help="SEQ:MICRO of the p1-big row, or none")
    add("--big-phase2", type=shape_arg, default=(512, 64), help="SEQ:MICRO of the p2-big row, or none")
    add("--accum1", type=int, default=32, help="micro-batches per optimizer step in the phase-1 rows")
    add("--accum2", type=int, default=32, help="micro-batches per optimizer step in the phase-2 rows")
    add("--steps", type=int, default=3, help="timed optimizer steps per row")
    add("--boundary-steps", type=int, default=8, help="timed steps of the one-micro-batch-per-step rows")
    add("--warmup", type=int, default=2, help="optimizer steps before timing (the first one compiles)")
    add("--num-workers", type=int, default=None, help="DataLoader workers (default: the recipe's data.num_workers)")
    add("--shard-instances", type=int, default=2048, help="instances per synthetic shard (epochs repeat them)")
    add("--vocab", type=int, default=VOCAB)
    add("--ds-config", type=Path, default=None,
        help="another DeepSpeed JSON of engine mechanics for every row (default: the recipe's)")
    add("--lamb-model", default="bert-large")
    add("--lamb-reps", type=int, default=10)
    add("--fused-on-cpu", action="store_true", help="also time the compiled LAMB on CPU")
    add("--compiled-selftest", action="store_true", help="the compiled layer's self-test on every self-test "
        "shape's longest seq, also where a run would not compile (CPU: inductor takes tens of seconds on 2 cores)")
    add("--comparisons", action="store_true", help="also the rows no recipe runs: p1-timer-on (DeepSpeed's throughput "
        "timer on), p1-big and p2-big (micro-batches 256 / 64); --rows naming one runs it too")
    add("--selftest-precisions", type=lambda t: [p for p in t.split(",") if p], default=None,
        help="the self-test table's precisions (default: those the recipes run on this device, e.g. bf16 alone on "
        "an H100: an fp16 row costs a compile no recipe uses; bf16,fp16 runs both); CPU: fp32,bf16")
    add("--contain-selftest", action="store_true", help="run the self-tests in a child process on CPU too (a CUDA "
        "device always does: a fault there cannot reach the check's own CUDA context); the tests use it")
    add("--part-budget", type=budget_arg, default={}, metavar="PART=S,...|none",
        help="seconds per part (selftest, p1, p2, lamb, p1-timer-on, p1-big, p2-big, *: the other recipes' phases) "
        "replacing the defaults for one H100/H200 (bench/gpu_check/budget.py); none: no part budgets; a part "
        "over its budget is stopped and the check goes on (--smoke: none unless given)")
    add("--inductor-cxx", default=None, help="the C++ compiler torch.compile uses on CPU (inductor's cpp.cxx); "
        "a missing one makes the fused LAMB compile fail (the test does this)")
    add("--peak-tflops", type=float, default=None, help="per device; default: by GPU name")
    add("--jsonl", type=Path, default=Path(DEFAULT_JSONL), help="one JSON line per row")
    add("--work-dir", type=Path, default=None, help="synthetic shards go here (default: a temporary folder)")
    add("--deadline", type=float, default=None, help="unix time by which to be done (gpu_check.sh passes its "
        "limit): rows that would start with under --reserve-s left are skipped, the estimate is printed")
    add("--reserve-s", type=float, default=45.0)
    add("--estimate-only", type=Path, default=None, metavar="ROWS.jsonl",
        help="measure nothing: print the estimate from the rows saved in ROWS.jsonl (other assumptions)")
    add("--estimate-recipes", type=paths_arg, default=paths_arg(ESTIMATE_RECIPES))
    add("--estimate-gpus", type=ints_arg, default=[8, 64, 256])
    add("--gpus-per-node", type=int, default=Network.gpus_per_node)
    add("--intra-node-busbw", type=float, default=Network.intra_node_busbw_gbs, help="GB/s, the estimate's")
    add("--inter-node-busbw", type=float, default=Network.inter_node_busbw_gbs, help="GB/s per GPU, the estimate's")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    if parser.parse_known_args(argv)[0].smoke:  # smoke defaults; flags given explicitly still win
        parser.set_defaults(**SMOKE_DEFAULTS)
    args = parser.parse_args(argv)
    for name in ("accum1", "accum2", "steps", "boundary_steps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    for recipe in [args.recipe, *args.also_recipes, *args.estimate_recipes]:
        if not recipe.is_file():
            parser.error(f"{recipe}: no such run config")
    precisions = {"fp32", "bf16", "fp16"}
    if args.selftest_precisions is not None and not set(args.selftest_precisions) <= precisions:
        parser.error(f"--selftest-precisions: expected some of bf16,fp16,fp32, got {','.join(args.selftest_precisions)}")
    args.part_budget = part_budgets(args.part_budget, args.smoke)
    args.network = Network(args.gpus_per_node, args.intra_node_busbw, args.inter_node_busbw)
    if args.rows is not None:
        every = argparse.Namespace(**{**vars(args), "rows": None, "comparisons": True})  # a flash GPU's, an older one's
        known = set(row_names(build_plan(every))) | set(row_names(build_plan(every, OLDER_GPU)))
        unknown = sorted(args.rows - known)
        if unknown:
            parser.error(f"--rows: unknown {','.join(unknown)} (known: {','.join(sorted(known))})")
    if args.inductor_cxx is not None:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.cxx = (None, args.inductor_cxx)
    return args
