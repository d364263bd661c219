"""Benchmark: what packing buys on real shards. Packing factor and padding, then packed vs unpacked
forward + backward time on the same instances (same masks), alternating in this process.

    python bench/packing.py SHARDS_DIR [--seq-len 512] [--micro-batch 32] [--preset bert-mini]
                            [--batches 8] [--reps 3]

Prints instances per row and padding share of the unpacked and packed layouts over `--batches`
micro-batches of the training stream, and the ratio of instances/s packed over unpacked
(median seconds per micro-batch). One process, CPU or the first GPU (bf16 autocast there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.data.batches import Collator, RankBatches, open_phase_data  # noqa: E402
from pretrain.data.packing import PackingMeter  # noqa: E402
from pretrain.model.bert import bert_config, build_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shards", type=Path)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=32, help="instances per micro-batch")
    parser.add_argument("--preset", default="bert-mini")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = open_phase_data(args.shards, args.seq_len, None, "shards", verify_checksums=False)
    stream = RankBatches(data, "train", 1, 0, 1, args.micro_batch)
    layouts: dict[str, list[dict[str, torch.Tensor]]] = {"unpacked": [], "packed": []}
    meters = {name: PackingMeter() for name in layouts}
    for k in range(min(args.batches, len(stream))):
        indices = stream.rank_indices(0)[k * args.micro_batch : (k + 1) * args.micro_batch]
        rows = [stream.reader[int(i)] for i in indices]
        for name in layouts:
            batch = Collator(data, packing=name == "packed")(rows, np.random.default_rng([1, k]))
            meters[name].observe(batch)
            layouts[name].append({key: value.to(device) for key, value in batch.items()})
    stats = {name: meter.take() for name, meter in meters.items()}
    for name in layouts:
        print(f"{name:9s} instances/row {stats[name]['data/packing_factor']:.2f}  padding "
              f"{stats[name]['data/padding_fraction']:.1%}", flush=True)
    config = bert_config(args.preset, data.vocab.size, max_position_embeddings=max(512, args.seq_len))
    model = build_model(config).to(device)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name, batches in layouts.items():
            for batch in batches:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = model(**batch).loss
                loss.backward()
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if rep:
                    times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name in layouts:
        print(f"{name:9s} fwd+bwd {medians[name] * 1e3:.0f} ms per micro-batch")
    print(f"packed / unpacked instances per second: {medians['unpacked'] / medians['packed']:.2f}x "
          f"({args.preset}, seq {args.seq_len}, {args.micro_batch} instances per micro-batch, {device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
