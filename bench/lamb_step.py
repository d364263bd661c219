"""Time one optimizer step on BERT-base / BERT-large parameter shapes; print medians and ratios.

    python bench/lamb_step.py [--models base,large] [--reps 7] [--device auto|cpu|cuda] [--layers N]
    deepspeed --num_gpus 2 bench/lamb_step.py --zero [--models base]   # ZeRO bookkeeping overhead
    python bench/lamb_step.py --bias-growth [--recipe RUN.json] [--steps 300]   # adapt_all pilot (CPU)

Single-process mode interleaves, in one process and on the same weights and gradients, ExactLamb
(`pretrain.optim.lamb.ExactLamb`), `torch.optim.AdamW(foreach=True)` (the baseline), `torch_optimizer.ExactLamb` (PyPI
`torch-optimizer`, skipped when absent) and the textbook per-tensor loop of pretrain/optim/lamb_reference.py.
It also measures a memory-copy bandwidth in the same run and prints the physical floor: LAMB must read
w, g, m, v and write m, v, u, then read u, w and write w (10 x 4 bytes per element in fp32); AdamW
needs 7 x 4 bytes.

--zero (2+ ranks, launched by deepspeed) gives each rank the flat fp32 partitions ZeRO-1/2 would
(two param groups, aligned, boundaries cutting parameters) and compares our exact per-parameter step
(segments + one all-reduce per partition) with the same ExactLamb treating each partition as one tensor.

--bias-growth trains the tiny BERT preset for the first --steps optimizer steps of a recipe's phase 1
(its DeepSpeed JSON and its schedule, built as the driver builds them; only model and batch are small)
twice: with the JSON's LAMB parameters and with adapt_all flipped. It prints how far the zero-initialised
biases (every Linear / LayerNorm bias, the MLM decoder bias) have moved and the MLM loss. Tokens follow
a Zipf law, so the decoder bias has a unigram prior to learn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.optim.lamb import ExactLamb, weight_decay_param_groups  # noqa: E402
from pretrain.optim.lamb_reference import NaiveLamb  # noqa: E402
from pretrain.optim.zero_layout import ZeroLayout, partition_from_ranges  # noqa: E402

BYTES_PER_ELEMENT = {"lamb": 10 * 4, "adamw": 7 * 4}


def bert_groups(model_name: str, layers: int | None) -> list[list[torch.Size]]:
    """Parameter shapes of BertForPreTraining (tied weights once), split decay / no-decay."""
    import transformers

    sizes = {"base": (768, 12, 12), "large": (1024, 24, 16)}[model_name]
    config = transformers.BertConfig(
        hidden_size=sizes[0],
        num_hidden_layers=layers or sizes[1],
        num_attention_heads=sizes[2],
        intermediate_size=4 * sizes[0],
        vocab_size=30522,
    )
    with torch.device("meta"):
        model = transformers.BertForPreTraining(config)
    return [[p.shape for p in g["params"]] for g in weight_decay_param_groups(model, 0.01)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Best bytes per second (read + write counted) of a large copy and a large in-place scale."""
    numel = (256 if device.type == "cpu" else 1024) * 2**20 // 4
    src, dst = torch.rand(numel, device=device), torch.zeros(numel, device=device)
    best = 0.0
    for kernel in (lambda: dst.copy_(src), lambda: dst.mul_(1.0)):
        times = []
        for _ in range(reps + 1):
            synchronize(device)
            start = time.perf_counter()
            kernel()
            synchronize(device)
            times.append(time.perf_counter() - start)
        best = max(best, 2 * numel * 4 / statistics.median(times[1:]))
    return best


def interleaved_medians(
    steps: dict[str, Callable[[], None]],
    reps: int,
    device: torch.device,
    before_each: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median seconds per call; the order rotates each repetition so drift hits every candidate."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps + 1):  # repetition 0 warms up (state allocation) and is dropped
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            before_each()
            synchronize(device)
            start = time.perf_counter()
            steps[name]()
            synchronize(device)
            if rep:
                times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def bench_model(model_name: str, args: argparse.Namespace, device: torch.device) -> None:
    shapes = bert_groups(model_name, args.layers)
    numel = sum(s.numel() for g in shapes for s in g)
    gen = torch.Generator(device=device).manual_seed(0)
    groups = []
    for wd, group_shapes in zip((0.01, 0.0), shapes, strict=True):
        params = [nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in group_shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
        groups.append({"params": params, "weight_decay": wd})

    def fresh_groups() -> list[dict]:
        return [dict(g) for g in groups]  # same tensors, separate group dicts per optimizer

    candidates: dict[str, torch.optim.Optimizer] = {
        "adamw_foreach": torch.optim.AdamW(fresh_groups(), lr=1e-3, foreach=True),
        "ours_lamb": ExactLamb(fresh_groups(), lr=1e-3),
    }
    try:
        import torch_optimizer

        candidates["torch_optimizer_lamb"] = torch_optimizer.Lamb(fresh_groups(), lr=1e-3)
    except ImportError:
        print("torch-optimizer is not installed (pip install torch-optimizer): its Lamb is skipped")
    if not args.skip_naive:
        candidates["naive_loop_lamb"] = NaiveLamb(fresh_groups(), lr=1e-3)
    bandwidth = copy_bandwidth(device, args.reps)
    medians = interleaved_medians({n: o.step for n, o in candidates.items()}, args.reps, device)
    base = medians["adamw_foreach"]
    print(
        f"\n== BERT-{model_name}{'' if args.layers is None else f' ({args.layers} layers)'}: "
        f"{numel / 1e6:.1f}M fp32 params, {sum(len(g) for g in shapes)} tensors, {device}, "
        f"{torch.get_num_threads()} threads, median of {args.reps}"
    )
    print(
        f"copy bandwidth {bandwidth / 1e9:.2f} GB/s; floors: LAMB {numel * BYTES_PER_ELEMENT['lamb'] / bandwidth * 1e3:.1f} ms, "
        f"AdamW {numel * BYTES_PER_ELEMENT['adamw'] / bandwidth * 1e3:.1f} ms"
    )
    for name, seconds in medians.items():
        print(f"{name:22s} {seconds * 1e3:9.1f} ms   x{seconds / base:5.2f} of AdamW-foreach")
    ours = medians["ours_lamb"]
    floor = numel * BYTES_PER_ELEMENT["lamb"] / bandwidth
    print(f"ours vs floor: x{ours / floor:.2f}")
    if "torch_optimizer_lamb" in medians:
        print(f"torch-optimizer Lamb / ours: x{medians['torch_optimizer_lamb'] / ours:.2f} (goal >= 3)")
    print(f"ours / AdamW-foreach: x{ours / base:.2f} (goal <= 1.5)")


def bench_zero(model_name: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from pretrain.distributed.process_group import init_distributed

    info = init_distributed()
    rank, world, device = info.rank, info.world_size, info.device
    flats, partitions = [], {}
    for key, group_shapes in enumerate(bert_groups(model_name, args.layers)):
        sizes = [s.numel() for s in group_shapes]
        total = sum(sizes)
        partition = -(-total // (2 * world)) * 2  # ZeRO aligns each group to 2 * dp elements
        start, end, offset, ranges = rank * partition, (rank + 1) * partition, 0, []
        for j, n in enumerate(sizes):
            lo, hi = max(offset, start), min(offset + n, end)
            if lo < hi:
                ranges.append((j, lo - start, hi - lo))
            offset += n
        flat = nn.Parameter(torch.randn(partition, device=device) * 0.02)
        flat.grad = torch.randn(partition, device=device) * 1e-3
        flats.append(flat)
        partitions[id(flat)] = partition_from_ranges(
            partition, ranges, len(sizes), dist.group.WORLD, key, None
        )
    exact = ExactLamb(
        [torch.empty(0)], lr=1e-3
    )  # constructed on a placeholder, then handed the flats like ZeRO does
    exact.param_groups[0]["params"] = flats
    exact.set_zero_layout(ZeroLayout(wrapper="bench", partitions=partitions))
    per_partition = ExactLamb([{"params": [f]} for f in flats], lr=1e-3)  # one ratio per flat: no bookkeeping
    medians = interleaved_medians(
        {"per_partition": per_partition.step, "exact": exact.step}, args.reps, device
    )
    overhead = torch.tensor([medians["exact"] / medians["per_partition"] - 1.0])
    dist.all_reduce(overhead, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(
            f"\n== ZeRO bookkeeping, BERT-{model_name}, {world} ranks, {sum(f.numel() for f in flats) / 1e6:.1f}M "
            f"elements per rank, {device}"
        )
        print(
            f"per-partition ratio (naive) {medians['per_partition'] * 1e3:.1f} ms, exact per-parameter "
            f"{medians['exact'] * 1e3:.1f} ms: overhead {overhead.item() * 100:+.1f}% (max over ranks; goal < 5%)"
        )


def bias_growth_run(args: argparse.Namespace, adapt_all_override: bool | None) -> dict[int, tuple[float, float, float]]:
    """Per reported step: mean |b| of the zero-initialised biases, of the MLM decoder bias, and the MLM loss."""
    from pretrain.config.deepspeed import deep_merge, phase_ds_config
    from pretrain.config.load import load_config
    from pretrain.engine import build_engine
    from pretrain.model.bert import bert_config, build_model
    from pretrain.schedules.lr import build_schedule

    micro, seq, vocab, predictions = 32, 32, 1000, 5
    config = load_config(args.recipe, [f"--phase1.batch_size={micro}", f"--phase1.micro_batch_size={micro}"])
    phase = config.phase("phase1")
    ds = phase_ds_config(config, "phase1", dp_size=1, device_type="cpu")
    if adapt_all_override is not None:
        ds = deep_merge(ds, {"optimizer": {"params": {"adapt_all": adapt_all_override}}})
    torch.manual_seed(0)
    model = build_model(bert_config("tiny", vocab, 64))
    zero_biases = [p for n, p in model.named_parameters() if n.endswith("bias") and not p.detach().any()]
    decoder_bias = model.cls.predictions.bias
    engine = build_engine(model, ds, lr_schedule=build_schedule(phase, phase.steps))
    zipf = 1.0 / torch.arange(1, vocab - 4, dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    report, losses = {}, []
    for step in range(1, args.steps + 1):
        ids = 5 + torch.multinomial(zipf, micro * seq, replacement=True, generator=generator).view(micro, seq)
        positions = torch.stack([torch.randperm(seq - 2, generator=generator)[:predictions] + 1 for _ in range(micro)])
        out = engine(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids),
                     masked_positions=positions, masked_labels=ids.gather(1, positions),
                     next_sentence_label=torch.zeros(micro, dtype=torch.long))
        engine.backward(out.loss)
        engine.step()
        losses.append(out.mlm_loss.item())
        if step in (1, 10, 30, 100, 300, 1000) or step == args.steps:
            moved = torch.cat([p.detach().abs().flatten() for p in zero_biases]).mean().item()
            recent = losses[-10:]
            report[step] = (moved, decoder_bias.detach().abs().mean().item(), sum(recent) / len(recent))
    return report


def bench_bias_growth(args: argparse.Namespace) -> None:
    from pretrain.config.load import load_config

    shipped = json.loads(Path(load_config(args.recipe).phase("phase1").ds_config).read_text(encoding="utf-8"))
    adapt_all = bool(shipped["optimizer"]["params"].get("adapt_all", False))
    runs = {f"adapt_all={str(adapt_all).lower()} (shipped)": bias_growth_run(args, None),
            f"adapt_all={str(not adapt_all).lower()}": bias_growth_run(args, not adapt_all)}
    print(f"\n== zero-initialised biases, tiny BERT, {args.recipe.name} phase-1 JSON and schedule, micro 32 x seq 32")
    print("| step | " + " | ".join(f"{name}: mean abs bias / decoder bias / MLM loss" for name in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for step in next(iter(runs.values())):
        cells = [f"{r[step][0]:.2e} / {r[step][1]:.2e} / {r[step][2]:.3f}" for r in runs.values()]
        print(f"| {step} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="base,large", help="comma list of base, large")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=None, help="override the encoder depth (memory)")
    parser.add_argument("--skip-naive", action="store_true", help="leave out the per-tensor loop")
    parser.add_argument("--zero", action="store_true", help="measure the ZeRO bookkeeping (2+ ranks)")
    parser.add_argument("--bias-growth", action="store_true", help="adapt_all pilot: zero-initialised biases")
    parser.add_argument("--recipe", type=Path, default=Path(__file__).resolve().parents[1] / "ds_configs" / "recipes"
                        / "bert_large_64k.json", help="--bias-growth: the recipe whose phase 1 is piloted")
    parser.add_argument("--steps", type=int, default=300, help="--bias-growth: optimizer steps")
    args, _ = parser.parse_known_args()  # the deepspeed launcher appends --local_rank
    for model_name in args.models.split(","):
        if model_name not in ("base", "large"):
            parser.error(f"--models: unknown model {model_name!r} (base, large)")
    if args.bias_growth:
        bench_bias_growth(args)
        return 0
    if args.zero:
        for model_name in args.models.split(","):
            bench_zero(model_name, args)
        return 0
    wanted = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if wanted == "auto" else wanted)
    for model_name in args.models.split(","):
        bench_model(model_name, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
