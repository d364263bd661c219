"""Which rows bench/gpu_check/run.py measures, in which order, on which engines.

A group is one DeepSpeed engine (built once: model init + engine start cost ~10 s for BERT-Large) and the
rows that share it; they differ only in the data they read and in the micro-batches per optimizer step.
The row that runs with one micro-batch per step ("-opt") comes last in its group: DeepSpeed finds its
accumulation boundary from a running micro-step count, which only a whole number of steps at the larger
accumulation leaves aligned.

Most important first, so that a time limit takes the least useful rows: the kernel self-test's verdict table
(seconds), the recipe's phase 1 and phase 2 as a run has them on this device (`model.attention=auto`: unpadded
where its kernel runs, pretrain/model/kernel_support.py), then the LAMB step, then, with --comparisons, the rows no
recipe runs (throughput timer on, the previous check's micro-batches 256 / 64), then the other recipes' models
(BERT-base).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pretrain.config.deepspeed import effective_precision
from pretrain.config.load import RunConfig, load_config
from pretrain.model.kernel_support import DeviceFacts, unpadded_problem
from pretrain.model.presets import PRESETS

LAMB_STAGE = "lamb"
SELFTEST_STAGE = "selftest"
TARGET_GPU = DeviceFacts("cuda", (9, 0), flash_built=True, bf16=True)  # what the check is for: an H100 / H200


@dataclass(frozen=True)
class RowSpec:
    name: str  # what --rows selects, e.g. "p1", "p2-packed", "bert_base:p1"
    what: str  # one line: what the row measures
    profile: str  # synthetic length profile (bench/gpu_check/shards.py): padded, full, varied
    packing: bool  # the phase's `packing`: several instances per row
    accumulation: int  # micro-batches per optimizer step
    unpadded: bool = False  # model.attention=unpadded's layout: the real tokens only (beats packing)


@dataclass(frozen=True)
class GroupSpec:
    """One engine: a phase of `recipe` at (preset, seq_len, micro_batch), DeepSpeed's throughput timer on or off."""

    recipe: Path
    phase: str
    preset: str
    seq_len: int
    micro_batch: int
    tput_timer: bool
    rows: tuple[RowSpec, ...]
    attention_check: bool = False  # check the kernel and padded == unpadded on this engine (a recipe's phase)
    part: str = ""  # its time budget's name (bench/gpu_check/budget.py): "p1", "p2-big", "bert_base:p1", ...


def recipe_shape(recipe: Path, phase: str) -> tuple[str, int, int]:
    """(model preset, seq_len, micro_batch_size) of one phase of a run config."""
    config = load_config(recipe)
    section = config.phase(phase)
    if section.micro_batch_size is None:
        raise ValueError(f"{recipe}: {phase}.micro_batch_size is not set (the check runs the recipe's micro-batch)")
    return config.model.preset, section.seq_len, section.micro_batch_size


def shape_of(args: argparse.Namespace, recipe: Path, phase: str) -> tuple[str, int, int]:
    """The recipe's shape, with --model and --phase1 / --phase2 (SEQ:MICRO) replacing it where given."""
    preset, seq, micro = recipe_shape(recipe, phase)
    given = getattr(args, phase)
    if given is not None:
        seq, micro = given
    return args.model or preset, seq, micro


def runs_unpadded(config: RunConfig, preset: str, facts: DeviceFacts) -> bool:
    """The path the driver takes for this recipe on a device with `facts` (auto: unpadded where its kernel runs)."""
    if config.model.attention != "auto":
        return config.model.attention == "unpadded"
    shape = PRESETS[preset]
    precision = effective_precision(config.run.precision, facts.device_type, facts.bf16)
    return unpadded_problem(facts, precision, shape["hidden_size"] // shape["num_attention_heads"]) is None


def main_groups(args: argparse.Namespace, recipe: Path, prefix: str, full: bool,
                facts: DeviceFacts = TARGET_GPU) -> list[GroupSpec]:
    """Phase 1 and phase 2 of `recipe` as a run has them (its attention path: unpadded, or padded rows, packed
    where the recipe packs; 10 % short instances in phase 1, lengths uniform in [seq/4, seq] in phase 2 when
    the layout removes padding; A micro-batches per step, timer off) and the optimizer-boundary rows in the
    same layout; with `full`, also the padded reference path, the unpadded-attention-mask and the packed
    comparisons."""
    groups = []
    config = load_config(recipe)
    for phase, short in (("phase1", "p1"), ("phase2", "p2")):
        preset, seq, micro = shape_of(args, recipe, phase)
        unpadded = runs_unpadded(config, preset, facts)
        accumulation = args.accum1 if phase == "phase1" else args.accum2
        packing = config.phase(phase).packing and not unpadded
        layout = "unpadded" if unpadded else "packed" if packing else "padded rows"
        profile = "varied" if phase == "phase2" and (unpadded or packing) else "padded"
        rows = [RowSpec(f"{prefix}{short}", f"{phase} as a run has it ({layout}): the recipe's micro-batch, "
                        f"{accumulation} micro-batches per optimizer step", profile, packing, accumulation, unpadded)]
        if full and unpadded:
            rows.append(RowSpec(f"{prefix}{short}-padded", "the same instances in padded rows (model.attention="
                                "padded, the reference path)", profile, False, accumulation))
        if full and phase == "phase1":
            rows.append(RowSpec(f"{prefix}{short}-full", "padded rows without padding: no attention mask "
                                "(SDPA may run flash)", "full", False, accumulation))
        if full and phase == "phase2" and not packing:
            rows.append(RowSpec(f"{prefix}{short}-packed", f"the same instances packed ({phase}.packing with "
                                "model.attention=padded)", "varied", True, accumulation))
        if full and phase == "phase2" and not unpadded:
            rows.append(RowSpec(f"{prefix}{short}-varied", "unpacked, lengths uniform in [seq/4, seq]",
                                "varied", False, accumulation))
        rows.append(RowSpec(f"{prefix}{short}-opt", "one micro-batch per optimizer step: with the first row "
                            "it separates the optimizer boundary's time", profile, packing, 1, unpadded))
        groups.append(GroupSpec(recipe, phase, preset, seq, micro, False, tuple(rows), attention_check=unpadded,
                                part=f"{prefix}{short}"))
    return groups


def comparison_groups(args: argparse.Namespace, recipe: Path, facts: DeviceFacts = TARGET_GPU) -> list[GroupSpec]:
    """The throughput timer on (DeepSpeed's default), and the previous check's larger micro-batches (in the
    recipe's attention path, as p1 / p2)."""
    preset, seq, micro = shape_of(args, recipe, "phase1")
    unpadded = runs_unpadded(load_config(recipe), preset, facts)
    groups = [GroupSpec(recipe, "phase1", preset, seq, micro, True, (
        RowSpec("p1-timer-on", "p1 with DeepSpeed's throughput timer on (its default)", "padded", False,
                args.accum1, unpadded),), part="p1-timer-on")]
    for phase, short, big, accumulation in (("phase1", "p1", args.big_phase1, args.accum1),
                                           ("phase2", "p2", args.big_phase2, args.accum2)):
        if big is None:
            continue
        preset, _, recipe_micro = shape_of(args, recipe, phase)
        big_seq, big_micro = big
        steps_of = max(2, accumulation * recipe_micro // max(big_micro, 1))  # the same sequences per step
        groups.append(GroupSpec(recipe, phase, preset, big_seq, big_micro, False, (
            RowSpec(f"{short}-big", f"micro-batch {big_micro} (the previous check's shape)", "padded", False,
                    steps_of, unpadded),), part=f"{short}-big"))
    return groups


def comparisons_wanted(args: argparse.Namespace, comparisons: list[GroupSpec]) -> bool:
    """The comparison rows run with --comparisons, or where --rows names one: no recipe runs them (DeepSpeed's
    throughput timer is off in the shipped JSON; the recipes' micro-batches are 64 / 16 and 128 / 32), so the
    first check on a GPU spends its 10 minutes on what the recipes run."""
    return args.comparisons or (args.rows is not None and bool(args.rows & set(row_names(list(comparisons)))))


def skipped_comparisons(args: argparse.Namespace, facts: DeviceFacts = TARGET_GPU) -> list[str]:
    """The comparison rows this run leaves out (the check counts them in its file; none when --rows picks rows)."""
    comparisons = comparison_groups(args, args.recipe, facts)
    return [] if args.rows is not None or comparisons_wanted(args, comparisons) else row_names(list(comparisons))


def build_plan(args: argparse.Namespace, facts: DeviceFacts = TARGET_GPU) -> list[GroupSpec | str]:
    """The self-test, the groups and the LAMB stage in the order they run on a device with `facts`, keeping only the
    rows --rows names (all by default; the comparison rows with --comparisons, `comparisons_wanted`)."""
    comparisons = comparison_groups(args, args.recipe, facts)
    stages: list[GroupSpec | str] = [SELFTEST_STAGE, *main_groups(args, args.recipe, "", True, facts), LAMB_STAGE,
                                     *(comparisons if comparisons_wanted(args, comparisons) else [])]
    for other in args.also_recipes:
        stages += main_groups(args, other, f"{other.stem}:", False, facts)
    if args.rows is None:
        return stages
    kept: list[GroupSpec | str] = []
    for stage in stages:
        if isinstance(stage, str):
            if stage in args.rows:
                kept.append(stage)
            continue
        rows = tuple(row for row in stage.rows if row.name in args.rows)
        if rows:
            kept.append(GroupSpec(**{**stage.__dict__, "rows": rows}))
    return kept


def part_names(stages: list[GroupSpec | str]) -> list[str]:
    """The parts the stages run, each with its own time budget (bench/gpu_check/budget.py)."""
    return [stage if isinstance(stage, str) else stage.part for stage in stages]


def row_names(stages: list[GroupSpec | str]) -> list[str]:
    return [name for stage in stages for name in ([stage] if isinstance(stage, str) else [r.name for r in stage.rows])]
