"""Benchmark: the driver's train step vs a bare loop on the same engine, and the sparse vs dense MLM head.

    python bench/train_step.py [--preset bert-mini] [--seq-len 128] [--micro-batch 16] [--steps 20]
                               [--accumulation 2] [--vocab-size 30522] [--zero-stage 2] [--num-workers 0]

1. tokens/s of `PhaseTrainer.train_step` (DeepSpeed engine, ExactLamb, gradient clipping, data
   loading + dynamic masking from real shard files read one step ahead, loss/accuracy bookkeeping, the
   split-independent MLM normalisation) against a bare loop on an identical engine (built the same way)
   over pre-collated micro-batches on the device: `engine(**batch)`, `backward`, `step`. What the ratio
   shows is the driver's own cost. Goal >= 0.9.
2. The same driver against a plain PyTorch loop (same model and ExactLamb and clipping, no DeepSpeed, one
   batch reused): DeepSpeed's own cost on one rank included, for reference.
3. forward+backward time of the sparse MLM head (logits only at masked positions) against
   transformers' dense `BertForPreTraining` head (logits at every position) on the same batch.

Both comparisons run in this process and alternate measurement blocks, so background load hits
both sides alike; the figures are medians of per-step times. One process, world size 1 (CPU or GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from data_prep.shard_format.atomic_io import atomic_write_json, sha256_file  # noqa: E402
from data_prep.shard_format.shards import FORMAT_NAME, FORMAT_VERSION, write_shard  # noqa: E402
from pretrain.checkpointing.checkpoint import CheckpointManager  # noqa: E402
from pretrain.config.load import load_config  # noqa: E402
from pretrain.distributed.process_group import init_distributed  # noqa: E402
from pretrain.distributed.stop_request import StopRequest  # noqa: E402
from pretrain.engine import build_engine  # noqa: E402
from pretrain.metrics.throughput import Throughput  # noqa: E402
from pretrain.metrics.writer import MetricsWriter  # noqa: E402
from pretrain.model.bert import build_model  # noqa: E402
from pretrain.optim.lamb import ExactLamb, weight_decay_param_groups  # noqa: E402
from pretrain.plan.run_plan import plan_run  # noqa: E402
from pretrain.schedules.lr import WarmupPolyDecay  # noqa: E402
from pretrain.trainer import PhaseState, PhaseTrainer, TrainerJob  # noqa: E402


def synthetic_shards(out: Path, vocab_size: int, seq_len: int, count: int, seed: int = 0) -> Path:
    """Random-token instances in the data_prep format (the content does not matter for speed)."""
    out.mkdir(parents=True, exist_ok=True)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"t{i}" for i in range(vocab_size - 5)]
    (out / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        body = rng.integers(5, vocab_size, seq_len - 3).tolist()
        a_len = seq_len // 2
        rows.append({"input_ids": [2] + body[: a_len - 2] + [3] + body[a_len - 2 :] + [3], "a_len": a_len,
                     "next_sentence_label": int(rng.integers(0, 2))})
    n, sha = write_shard(out / f"seq{seq_len}" / "train-00000.arrow", rows, vocab_size, static_masking=False)
    atomic_write_json(out / "manifest.json", {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tool_version": "bench",
        "vocab": {"file": "vocab.txt", "sha256": sha256_file(out / "vocab.txt"), "size": vocab_size, "lowercase": True},
        "masking": {"mode": "dynamic", "mask_prob": 0.15, "whole_word": False, "dupe_factor": 1,
                    "max_predictions": {str(seq_len): max(1, round(seq_len * 0.15))}},
        "seed": seed, "config": {}, "totals": {},
        "seq_lens": {str(seq_len): {"train": {"num_instances": n, "shards": [
            {"file": f"seq{seq_len}/train-00000.arrow", "num_instances": n, "sha256": sha}]}}},
    })
    return out


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def alternate(named: dict[str, Callable[[], object]], steps: int, block: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call of each function, measured in alternating blocks of `block` calls."""
    times: dict[str, list[float]] = {name: [] for name in named}
    while min(len(t) for t in times.values()) < steps:
        for name, fn in named.items():
            times[name].extend(timed(fn, device) for _ in range(block))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bert-mini")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--num-workers", type=int, default=0,
                        help="DataLoader workers of the driver (on a 2-core box a worker competes with the compute)")
    args = parser.parse_args(argv)

    dist_info = init_distributed()
    device = dist_info.device
    work = Path(tempfile.mkdtemp(prefix="bench_train_step_"))
    shards = synthetic_shards(work / "shards", args.vocab_size, args.seq_len, count=args.micro_batch * 64)
    overrides = [
        f"--data.shards={shards}", f"--data.num_workers={args.num_workers}", f"--run.dir={work / 'run'}",
        f"--model.preset={args.preset}", '--run.phases=["phase1"]', f"--phase1.seq_len={args.seq_len}",
        f"--phase1.ds_config={REPO_ROOT / 'ds_configs' / 'deepspeed' / 'lamb_zero2_cpu.json'}",
        "--phase1.steps=1000000", f"--phase1.micro_batch_size={args.micro_batch}",
        f"--phase1.gradient_accumulation_steps={args.accumulation}",
        f"--phase1.ds_overrides.zero_optimization.stage={args.zero_stage}",
        "--phase1.lr=1e-3", "--logging.tensorboard=false", "--model.overrides.hidden_dropout_prob=0.0",
        "--model.overrides.attention_probs_dropout_prob=0.0",
    ]
    config = load_config(None, overrides)
    plan = plan_run(config, dist_info, verify_checksums=False)
    phase = plan.phases["phase1"]
    model_config = phase.model_config

    # --- the driver: engine + trainer exactly as pretrain.train builds them
    def engine_like_the_driver() -> object:
        torch.manual_seed(0)
        return build_engine(build_model(model_config), plan.ds_configs["phase1"],
                            lr_schedule=WarmupPolyDecay(1_000_000, 0.0))

    from pretrain.data.batches import RankBatches
    from pretrain.data.loader import model_inputs

    batches = RankBatches(phase.data, "train", 0, 0, 1, args.micro_batch)
    job = TrainerJob(work / "run", plan.resolved, dist_info, CheckpointManager(work / "ckpt", 1, 0),
                     MetricsWriter(None, False), StopRequest())
    trainer = PhaseTrainer(job, phase.trainer, engine_like_the_driver(), batches, None,
                           Throughput.of(phase.throughput, 1), PhaseState("phase1"))

    # --- baseline 1: a bare loop on an identical engine over the same micro-batches, already on the device
    same_engine = engine_like_the_driver()
    device_batches = [model_inputs(batches[k], device) for k in range(args.accumulation)]

    def same_engine_step() -> None:
        for batch in device_batches:
            same_engine.backward(same_engine(**batch).loss)
            same_engine.step()

    # --- baseline 2: the same model and optimizer in a plain PyTorch loop on one batch (no DeepSpeed)
    torch.manual_seed(0)
    bare = build_model(model_config).to(device)
    optimizer = ExactLamb(weight_decay_param_groups(bare, 0.01), lr=1e-3)
    fixed = {k: v.to(device) for k, v in batches[0].items()}

    def bare_step() -> None:
        for _ in range(args.accumulation):
            (bare(**fixed).loss / args.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # --- sparse vs dense head, forward + backward only
    from transformers import BertForPreTraining

    sparse = build_model(model_config).to(device)
    dense = BertForPreTraining(model_config).to(device)
    dense.load_state_dict(sparse.state_dict())
    dense_labels = torch.full_like(fixed["input_ids"], -100)
    dense_labels.scatter_(1, fixed["masked_positions"], fixed["masked_labels"])
    dense_labels[:, 0] = -100  # padding slots of masked_positions point at position 0 ([CLS])

    def sparse_step() -> None:
        sparse(**fixed).loss.backward()

    def dense_step() -> None:
        dense(input_ids=fixed["input_ids"], token_type_ids=fixed["token_type_ids"],
              attention_mask=fixed["attention_mask"], labels=dense_labels,
              next_sentence_label=fixed["next_sentence_label"]).loss.backward()

    for fn in (trainer.train_step, same_engine_step, bare_step, sparse_step, dense_step):
        for _ in range(args.warmup):
            fn()
    steps = alternate({"driver": trainer.train_step, "same_engine": same_engine_step, "bare": bare_step},
                      args.steps, 5, device)
    heads = alternate({"sparse": sparse_step, "dense": dense_step}, args.steps, 5, device)
    tokens = args.micro_batch * args.seq_len * args.accumulation
    result = {
        "device": str(device), "preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "accumulation": args.accumulation, "vocab_size": args.vocab_size, "zero_stage": args.zero_stage,
        "num_workers": args.num_workers,
        "driver_tokens_per_s": tokens / steps["driver"], "same_engine_tokens_per_s": tokens / steps["same_engine"],
        "bare_tokens_per_s": tokens / steps["bare"],
        "driver_over_same_engine": steps["same_engine"] / steps["driver"],
        "driver_over_bare": steps["bare"] / steps["driver"],
        "sparse_fwd_bwd_s": heads["sparse"], "dense_fwd_bwd_s": heads["dense"],
        "sparse_speedup": heads["dense"] / heads["sparse"],
    }
    print(json.dumps(result, indent=2))
    print(f"driver / bare loop on the same engine: {result['driver_over_same_engine']:.3f} (goal >= 0.9); "
          f"driver / plain PyTorch: {result['driver_over_bare']:.3f}; "
          f"sparse MLM head speed-up over dense: {result['sparse_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
