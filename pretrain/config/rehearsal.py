"""Shrink a shipped recipe to toy sizes, keeping every choice that decides which code path runs.

    python -m pretrain.config.rehearsal RUN.json --shards DIR --out DIR [--ranks 2] [--steps 4] [--seq-lens 128,512]
    ./launch.sh pretrain --cpu --gpus 2 --config DIR/run.json          # the rehearsal itself

A GPU recipe (bf16 + ZeRO-1 + fp32 gradient accumulation, i.e. DeepSpeed's BF16_Optimizer around our
LAMB) can fail in ways a fp32 CPU test never shows: at the phase-1 export, at phase 2's start, on
resume. So the tests, and a user before spending GPU hours, run the shipped file itself with only
the sizes changed:

    changed (sizes)          model preset -> tiny; phase steps; sequence lengths (to the shards');
                             phaseN.batch_size / micro_batch_size (accumulation stays > 1); ZeRO
                             bucket sizes; checkpoint and validation intervals (and validation
                             instances); codistillation burn-in and refresh interval;
                             DataLoader workers (at most 1); run folder; no progress bar
    precision                what a GPU with bf16 gets (`run.precision` resolved for CUDA: auto ->
                             bf16). CPU DeepSpeed runs bf16; it cannot run fp16 (no fp16 on the CPU
                             accelerator), which a rehearsal of an fp16 recipe then reports
    kept (paths)             ZeRO stage, grad_accum_dtype, clipping, optimizer type and every LAMB
                             parameter, lr, packing, activation checkpointing, phases, init_from, LR
                             schedule shape, keep-last, export, failure limits, codistillation mode

The shrunk RUN.json names the shipped DeepSpeed JSONs (absolute paths) and carries the batch in the
phase keys that own it and only the bucket sizes as `phaseN.ds_overrides`, so what a recipe's
DeepSpeed file says is read from that file at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from data_prep.shard_format.atomic_io import atomic_write_bytes
from pretrain.config.deepspeed import deep_merge, effective_precision
from pretrain.config.load import PHASE_NAMES
from pretrain.run_folder import EXCHANGE

TOY_PRESET = "tiny"
TOY_MICRO_BATCH = 2
TOY_ACCUMULATION = 2  # > 1, so gradient accumulation (and its fp32 buffers) is on the rehearsed path
TOY_BUCKET = 4096  # elements: several reduce / all-gather buckets even for a tiny model
_BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "sub_group_size", "stage3_max_live_parameters",
                "stage3_max_reuse_distance")


def gpu_precision(run_precision: str) -> str:
    """The precision the driver picks on a GPU with bf16 (the recipes' target)."""
    return effective_precision(run_precision, "cuda", bf16_supported=True)


def shrink_ds_config(ds: dict[str, Any]) -> dict[str, Any]:
    """Size overrides for one phase's DeepSpeed dict: small ZeRO buckets (the batch is the run config's)."""
    zero = ds.get("zero_optimization", {})
    small = {key: TOY_BUCKET for key in _BUCKET_KEYS if key in zero}
    return {"zero_optimization": small} if small else {}


def shrink_batch(phase: dict[str, Any], data_parallel: int) -> None:
    """A phase's batch keys at toy size, in place: accumulation 2 (derived unless the recipe pins it)."""
    phase.update(batch_size=TOY_MICRO_BATCH * TOY_ACCUMULATION * data_parallel, micro_batch_size=TOY_MICRO_BATCH)
    if phase.get("gradient_accumulation_steps") is not None:
        phase["gradient_accumulation_steps"] = TOY_ACCUMULATION


def shrink_run_config(
    run: dict[str, Any],
    recipe_dir: Path,
    shards: Path,
    out: Path,
    ranks: int = 2,
    steps: int = 4,
    seq_lens: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The shipped RUN.json `run` (read from `recipe_dir`) at toy sizes; see the module docstring.

    `ranks` is the job's world size (codistillation splits it into groups), `seq_lens` maps phase
    names to the lengths the `shards` have (default: the recipe's own).
    """
    shrunk = json.loads(json.dumps(run))  # a deep copy that stays JSON
    groups = 1
    codistill = shrunk.get("codistill", {})
    if codistill.get("enabled"):
        groups = 1 if codistill.get("group") is not None else int(codistill.get("groups", 2))
        codistill["burn_in_steps"] = min(int(codistill.get("burn_in_steps", 0)), 1)
        codistill["refresh_every"] = 2
        if codistill.get("exchange_dir"):
            codistill["exchange_dir"] = str(out / EXCHANGE)
    if ranks % groups:
        raise ValueError(f"--ranks {ranks} does not split into codistill.groups={groups} equal groups")
    section = shrunk.setdefault("run", {})
    section.update(dir=str(out / "run"), stop_after_steps=None)
    model = shrunk.setdefault("model", {})
    model["preset"] = TOY_PRESET
    model["overrides"] = {key: value for key, value in model.get("overrides", {}).items()
                          if key not in ("vocab_size", "max_position_embeddings")}
    data = shrunk.setdefault("data", {})
    data.update(shards=str(shards), num_workers=min(int(data.get("num_workers", 2)), 1))
    for name in PHASE_NAMES:
        if name not in shrunk:
            continue
        phase = shrunk[name]
        ds_path = Path(phase["ds_config"])
        ds_path = ds_path if ds_path.is_absolute() else (recipe_dir / ds_path).resolve()
        ds = deep_merge(json.loads(ds_path.read_text(encoding="utf-8")), phase.get("ds_overrides", {}))
        phase.update(ds_config=str(ds_path), steps=steps, shards=None,
                     ds_overrides=deep_merge(phase.get("ds_overrides", {}), shrink_ds_config(ds)))
        shrink_batch(phase, ranks // groups)
        if seq_lens and name in seq_lens:
            phase["seq_len"] = seq_lens[name]
            phase["max_predictions"] = None
    section["precision"] = gpu_precision(section.get("precision", "auto"))
    checkpoint = shrunk.setdefault("checkpoint", {})
    checkpoint.update(dir=None, every_steps=2)
    logging = shrunk.setdefault("logging", {})
    logging.update(progress_bar=False, val_every_steps=2, val_batches=1)
    if logging.get("val_instances") is not None:
        logging["val_instances"] = TOY_MICRO_BATCH * ranks  # the same held-out instances, a few of them
    return shrunk


def shrink_squad_ds_config(ds: dict[str, Any]) -> dict[str, Any]:
    """A SQuAD DeepSpeed JSON with small buckets (everything else as shipped; the batch is squad_toy_flags')."""
    return deep_merge(ds, shrink_ds_config(ds))


def squad_toy_flags(data_parallel: int) -> list[str]:
    """The finetune flags of a toy batch on `data_parallel` ranks, with accumulation (as shrink_batch)."""
    return ["--batch-size", str(TOY_MICRO_BATCH * TOY_ACCUMULATION * data_parallel),
            "--micro-batch-size", str(TOY_MICRO_BATCH)]


def out_refused(out: Path) -> str | None:
    """Why --out cannot hold the rehearsal's run.json, or None. Whoever can write the folder can swap run.json,
    and run.json names the checkpoints and data the launch loads: an --out that exists must be a folder (not a
    link) owned by you that not everyone can write (a fixed name in the temp folder may well be someone else's).
    A group-writable folder is your umask's choice (002 shares with your group), as for every folder you make."""
    try:
        info = os.lstat(out)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return "is a link or a file, not a folder"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not to you"
    if info.st_mode & 0o002:
        return f"is writable by everyone (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.config.rehearsal", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a shipped RUN.json (ds_configs/recipes/*.json)")
    parser.add_argument("--shards", type=Path, required=True, help="a data_prep output folder (small is fine)")
    parser.add_argument("--out", type=Path, required=True, help="where run.json and the rehearsal's run go")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks the rehearsal runs on")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per phase")
    parser.add_argument("--seq-lens", default=None, help="phase1,phase2 lengths of the shards (default: the recipe's)")
    args = parser.parse_args(argv)
    if not (args.shards / "manifest.json").is_file():
        print(f"error: --shards {args.shards}: no manifest.json (make shards with ./launch.sh prep first)",
              file=sys.stderr)
        return 2
    try:
        run = json.loads(args.config.read_text(encoding="utf-8"))
        lengths = None
        if args.seq_lens:
            lengths = dict(zip(PHASE_NAMES, (int(v) for v in args.seq_lens.split(",")), strict=False))
        shrunk = shrink_run_config(run, args.config.resolve().parent, args.shards.resolve(), args.out.resolve(),
                                   args.ranks, args.steps, lengths)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {args.config}: {err}", file=sys.stderr)
        return 2
    refused = out_refused(args.out)
    if refused:
        print(f"error: --out {args.out}: {refused}; choose a folder of your own (`mktemp -d` makes one)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out / "run.json", (json.dumps(shrunk, indent=2) + "\n").encode("utf-8"))
    print(f"wrote {args.out / 'run.json'} (precision {shrunk['run']['precision']}); rehearse it with:\n"
          f"  ./launch.sh pretrain --cpu --gpus {args.ranks} --config {args.out / 'run.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
