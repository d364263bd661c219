"""Rescale a shipped run config to the global batches a user can afford (`./launch.sh scale`).

    python -m pretrain.launch.scale RUN.json --phase1-batch N [--phase2-batch M] [--gpus G]
                             [--gpu-memory-gb 80] [--phase1-micro U] [--phase2-micro V] --out NEW.json

Why: the shipped recipes are the LAMB paper's 64K/32K (or 32K/32K) batches; most users have 8-64 GPUs
and want 2K-8K. Changing only `train_batch_size` would keep the 64K learning rate, warmup and step count,
which is the wrong recipe at 4K. The rules applied per phase, from the reference (shipped) batch B0 to
the new batch B, k = B / B0 (the LAMB paper's own rules for its batch sweep, Table 4):

    lr      = lr0 * sqrt(k)                      square-root scaling
    steps   = round(steps0 / k)                  the same samples seen in the phase
    warmup  = warmup_fraction0 * k of the steps  the same number of warmup steps: warmup in samples (epochs)
                                                 grows linearly with the batch ("linear-epoch warmup")

The micro-batch per GPU is the largest divisor of B / G that fits the memory hint (the shipped micro
batch scaled by --gpu-memory-gb / 80, the size the shipped JSONs are taken to be sized for), and the
accumulation fills the rest. The new run config names the same DeepSpeed JSONs (paths made relative
to NEW.json) and writes the keys that own what changed: `phaseN.batch_size`, `phaseN.micro_batch_size`
(no `gradient_accumulation_steps`: the driver derives it for the ranks that run the job), `phaseN.lr`,
`steps` and `warmup_fraction`; it is loaded back with the driver's own `load_config` +
`phase_ds_config` for G ranks before it is written, so what is written runs. Bad input stops with one
line naming the value (exit 2).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpointing.cadence import advised_interval
from pretrain.checkpointing.footprint import model_fields
from pretrain.config.deepspeed import phase_ds_config
from pretrain.config.load import PHASE_NAMES, RunConfig, load_config
from pretrain.errors import ConfigError, exit_on_error
from pretrain.plan.footprint_plan import JobSizing, run_footprint

# What the shipped micro batches are taken to be sized for (not yet measured on a GPU: bench/gpu_check/gpu_check.sh).
REFERENCE_GPU_MEMORY_GB = 80.0

# The LAMB paper (You et al., ICLR 2020, arXiv 1904.00962), as we read it; check the paper before quoting.
PAPER_BATCH_SWEEP = (  # Table 4: untuned LAMB, sqrt lr scaling, linear-epoch warmup, fixed epochs
    (512, 5e-3 / 2**3.0, 1 / 320, 91.752),
    (1024, 5e-3 / 2**2.5, 1 / 160, 91.761),
    (2048, 5e-3 / 2**2.0, 1 / 80, 91.946),
    (4096, 5e-3 / 2**1.5, 1 / 40, 91.137),
    (8192, 5e-3 / 2**1.0, 1 / 20, 91.263),
    (16384, 5e-3 / 2**0.5, 1 / 10, 91.345),
    (32768, 5e-3, 1 / 5, 91.475),
)  # (batch, lr, warmup ratio, SQuAD v1.1 F1 of BERT-Large)
PAPER_HEADLINES = (
    "64K/32K mixed batch, 8,599 steps: SQuAD v1.1 F1 90.584 (Table 1)",
    "32K batch, 15,625 steps: F1 91.460 (Table 1); Adam at batch 512 (baseline): F1 90.395",
)


@dataclass(frozen=True)
class PhaseScale:
    """One phase before and after: the numbers printed and written."""

    name: str
    batch0: int
    batch: int
    lr0: float
    lr: float
    steps0: int
    steps: int
    warmup0: float
    warmup: float
    micro: int
    accumulation: int
    gpus: int

    @property
    def ratio(self) -> float:
        return self.batch / self.batch0

    @property
    def samples0(self) -> int:
        return self.batch0 * self.steps0

    @property
    def samples(self) -> int:
        return self.batch * self.steps


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest d <= limit with n % d == 0 (1 always qualifies)."""
    for d in range(min(n, max(1, limit)), 0, -1):
        if n % d == 0:
            return d
    return 1


def scale_phase(
    name: str,
    batch0: int,
    lr0: float,
    steps0: int,
    warmup0: float,
    micro0: int,
    batch: int,
    gpus: int,
    gpu_memory_gb: float,
    micro: int | None = None,
) -> PhaseScale:
    """The paper's rules for one phase; raises ConfigError naming the flag when the batch does not fit."""
    flag = f"--{name}-batch"
    if batch <= 0:
        raise ConfigError(f"{flag} {batch}: must be > 0")
    if batch % gpus:
        raise ConfigError(f"{flag} {batch}: not divisible by --gpus {gpus} (each GPU needs a whole share)")
    k = batch / batch0
    steps = max(1, round(steps0 / k))
    warmup = warmup0 * steps0 / steps  # the same number of warmup steps as the reference
    if warmup >= 1.0:
        raise ConfigError(
            f"{flag} {batch}: too large for this phase: its {steps} steps would all be warmup "
            f"(the reference warms up for {warmup0 * steps0:.0f} steps)"
        )
    per_gpu = batch // gpus
    if micro is not None:
        if micro <= 0 or per_gpu % micro:
            raise ConfigError(
                f"--{name}-micro {micro}: must divide the per-GPU batch {batch} / {gpus} = {per_gpu}"
            )
        chosen = micro
    else:
        limit = max(1, math.floor(micro0 * gpu_memory_gb / REFERENCE_GPU_MEMORY_GB))
        chosen = largest_divisor_at_most(per_gpu, limit)
    return PhaseScale(
        name,
        batch0,
        batch,
        lr0,
        lr0 * math.sqrt(k),
        steps0,
        steps,
        warmup0,
        warmup,
        chosen,
        per_gpu // chosen,
        gpus,
    )


def reference(config: RunConfig, name: str) -> tuple[int, float, int]:
    """The shipped phase's global batch, lr and micro batch: its keys in the run config."""
    phase = config.phase(name)
    if phase.batch_size is None or phase.batch_size <= 0:
        raise ConfigError(f"{name}.batch_size: not set, so no batch_size to scale from (the recipe gives a micro "
                          "batch and accumulation only; its global batch depends on the GPU count)")
    if phase.lr is None or phase.lr <= 0:
        raise ConfigError(f"{name}.lr: not set, so no learning rate to scale from")
    return phase.batch_size, float(phase.lr), int(phase.micro_batch_size or 1)


def scaled_config(
    raw: dict[str, Any], config: RunConfig, scales: list[PhaseScale], out: Path
) -> dict[str, Any]:
    """The new RUN.json: the original with each scaled phase's steps, warmup, lr and batch replaced."""
    new = copy.deepcopy(raw)
    for name in PHASE_NAMES:  # every DeepSpeed JSON path, relative to the new file's folder
        if isinstance(new.get(name), dict) and new[name].get("ds_config"):
            ds_path = Path(config.phase(name).ds_config).resolve()
            new[name]["ds_config"] = os.path.relpath(ds_path, out.resolve().parent)
    for s in scales:
        phase = new.setdefault(s.name, {})
        # The accumulation is left to the driver, derived for the ranks that run the job, so the run can
        # also resume on another number of GPUs (docs/elastic_resume.md).
        phase.pop("gradient_accumulation_steps", None)
        phase.update(batch_size=s.batch, micro_batch_size=s.micro, steps=s.steps,
                     warmup_fraction=round(s.warmup, 6), lr=float(f"{s.lr:.6g}"))
    # A run folder of its own: resuming the shipped recipe's checkpoints with another batch would be wrong.
    new.setdefault("run", {})["dir"] = str(Path(config.run.dir).parent / out.stem)
    batches = ", ".join(f"{s.name} {s.batch:,} sequences, lr {s.lr:.3g}, {s.steps:,} steps" for s in scales)
    original = config.run.about or f"the recipe in {config.run.dir}"
    new["run"]["about"] = (f"{original} -- rescaled by ./launch.sh scale with the "
                           f"LAMB paper's rules (sqrt lr, same samples and warmup steps): {batches}")
    new.get("checkpoint", {}).pop("dir", None)
    return new


def explain(scales: list[PhaseScale], source: Path, out: Path, run_dir: str) -> str:
    """What changed and why, with the paper's reference points."""
    lines = [f"{source} -> {out}  (run.dir {run_dir})", ""]
    for s in scales:
        lines += [
            f"{s.name}: global batch {s.batch0:,} -> {s.batch:,} (x{s.ratio:g})",
            f"  lr              {s.lr0:.4g} -> {s.lr:.4g}   "
            f"(x sqrt({s.ratio:g}) = x{math.sqrt(s.ratio):.4g}: "
            "square-root scaling)",
            f"  steps           {s.steps0:,} -> {s.steps:,}   (samples {s.samples0:,} -> {s.samples:,}, "
            f"{(s.samples / s.samples0 - 1) * 100:+.3f} %: the same data seen)",
            f"  warmup_fraction {s.warmup0:.4g} -> {s.warmup:.4g}   ({s.warmup0 * s.steps0:,.0f} -> "
            f"{s.warmup * s.steps:,.0f} warmup steps: linear-epoch warmup keeps the warmup steps)",
            f"  per step        {s.micro} micro x {s.accumulation} accumulation x {s.gpus} GPUs "
            f"= {s.batch:,}",
        ]
    lines += [
        "",
        "Why: the LAMB paper's batch sweep (Table 4) kept BERT-Large's SQuAD F1 within 91.1-91.9 from",
        "batch 512 to 32K with exactly these rules and no other tuning. Its reference points (as we read",
        "the paper; check before quoting):",
    ]
    for batch, lr, warmup, f1 in PAPER_BATCH_SWEEP:
        lines.append(f"  batch {batch:>6,}: lr {lr:.3g}, warmup 1/{round(1 / warmup)} of the steps, F1 {f1}")
    lines += [f"  {line}" for line in PAPER_HEADLINES]
    lines += ["Measured in this toolkit at small scale (docs/large_batch.md): the rule over-scaled LAMB's lr",
              "16x up in a 64-step run; with one tuning run to spare, try half the scaled lr beside it."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="./launch.sh scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a run config (e.g. ds_configs/recipes/bert_large_64k.json)")
    for name in PHASE_NAMES:
        parser.add_argument(
            f"--{name}-batch", type=int, help=f"new global batch of {name} (sequences per step)"
        )
        parser.add_argument(
            f"--{name}-micro", type=int, help=f"micro batch per GPU of {name} (default: derived)"
        )
    parser.add_argument(
        "--gpus", type=int, default=8, help="data-parallel ranks in all (nodes x GPUs); default 8"
    )
    parser.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=REFERENCE_GPU_MEMORY_GB,
        help="memory per GPU; the shipped micro batches are taken as what fits 80 GB",
    )
    parser.add_argument("--out", type=Path, required=True, help="the new run config to write")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> str:
    """Scale, validate through the driver's own config code, write; returns the explanation."""
    if args.gpus <= 0:
        raise ConfigError(f"--gpus {args.gpus}: must be > 0")
    if args.gpu_memory_gb <= 0:
        raise ConfigError(f"--gpu-memory-gb {args.gpu_memory_gb}: must be > 0")
    try:
        raw = json.loads(args.config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{args.config}: not a readable run config: {err}") from err
    config = load_config(args.config)
    wanted = {name: getattr(args, f"{name}_batch") for name in PHASE_NAMES}
    if all(value is None for value in wanted.values()):
        raise ConfigError("give --phase1-batch and/or --phase2-batch")
    scales = []
    for name, batch in wanted.items():
        if batch is None:
            continue
        if name not in config.run.phases:
            raise ConfigError(
                f"--{name}-batch: {args.config} does not run {name} (run.phases {config.run.phases})"
            )
        batch0, lr0, micro0 = reference(config, name)
        phase = config.phase(name)
        scales.append(
            scale_phase(
                name,
                batch0,
                lr0,
                phase.steps,
                phase.warmup_fraction,
                micro0,
                batch,
                args.gpus,
                args.gpu_memory_gb,
                getattr(args, f"{name}_micro"),
            )
        )
    new = scaled_config(raw, config, scales, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(new, indent=2) + "\n", encoding="utf-8")
    try:  # what the driver will do with it, for this GPU count
        check = load_config(tmp)
        for s in scales:
            ds = phase_ds_config(check, s.name, args.gpus, "cuda", bf16_supported=True)
            if (ds["train_batch_size"], ds["gradient_accumulation_steps"]) != (s.batch, s.accumulation):
                raise ConfigError(
                    f"{s.name}: the driver would run batch {ds['train_batch_size']} x accumulation "
                    f"{ds['gradient_accumulation_steps']}, not {s.batch} x {s.accumulation}"
                )
    except ConfigError:
        tmp.unlink()
        raise
    tmp.replace(args.out)
    return "\n".join([explain(scales, args.config, args.out, new["run"]["dir"]), "",
                      checkpoint_interval_line(check, args.gpus)])


BERT_VOCAB = 30522  # bert-base-uncased's: the size estimate's vocab before the shards are read


def checkpoint_interval_line(config: RunConfig, gpus: int) -> str:
    """The checkpoint interval that fits the job's failure rate at `gpus` GPUs (Young/Daly): from the run's
    measured save cost when its folder has one, else from the largest phase's checkpoint (run_footprint's size)."""
    fields = model_fields(config.model.preset, dict(config.model.overrides), BERT_VOCAB, 512)
    ds_configs = {name: phase_ds_config(config, name, gpus, "cuda", bf16_supported=True) for name in config.run.phases}
    footprint = run_footprint(config, JobSizing(fields, 0, ds_configs, dp_size=gpus, models=1))
    return f"Checkpoints: {advised_interval(Path(config.run.dir), footprint.checkpoint, gpus)}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_on_error(lambda: print(run(args)), ConfigError, prefix="scale: error: ")


if __name__ == "__main__":
    sys.exit(main())
