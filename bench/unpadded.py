"""Benchmark: padded eager vs unpadded eager vs unpadded compiled, one process, in real tokens/s.

    python bench/unpadded.py [--preset bert-mini] [--phases p1,p2] [--batches 4] [--reps 3]

The same micro-batches (the production collate, pretrain/data/batches.py `Collator`, in both layouts from the
same rows and masks) go through forward + backward of the same model, one path after the other in each
repetition; the median seconds per micro-batch gives real (non-padding) tokens/s and the ratios against
padded eager. Compiling (pretrain/model/compiled.py) is timed apart: the first compiled micro-batches of a
phase, and the compile seconds torch reports. Length profiles, as data_prep builds instances:

    p1   seq 128, 32 instances per micro-batch: 90 % full length, 10 % uniform in [8, 128] (short_seq_prob)
    p2   seq 512, 8 instances per micro-batch: lengths uniform in [128, 512] (about 37 % padding)

CPU or the first GPU (bf16 autocast there). Random token ids over a 30,522-piece vocab (BERT's size),
so the sparse MLM head costs what it costs in a run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.data.batches import Collator, PhaseData, Vocab  # noqa: E402
from pretrain.data.unpadded import real_tokens  # noqa: E402
from pretrain.model.bert import bert_config, build_model  # noqa: E402
from pretrain.model.compiled import compile_layers, compile_seconds  # noqa: E402

VOCAB_SIZE = 30522
PROFILES = {"p1": (128, 32), "p2": (512, 8)}  # seq_len, instances per micro-batch


def synthetic_vocab(folder: Path) -> Vocab:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    path = folder / "vocab.txt"
    path.write_text("\n".join(specials + [f"w{i}" for i in range(VOCAB_SIZE - len(specials))]) + "\n")
    return Vocab.load(path)


def lengths_of(profile: str, count: int, rng: np.random.Generator) -> list[int]:
    seq = PROFILES[profile][0]
    if profile == "p1":
        return [seq if rng.random() >= 0.1 else int(rng.integers(8, seq + 1)) for _ in range(count)]
    return [int(n) for n in rng.integers(seq // 4, seq + 1, count)]


def micro_batches(data: PhaseData, profile: str, batches: int, device: torch.device) -> dict[str, list[dict]]:
    """`batches` micro-batches of the profile in both layouts: the same rows, the same masks."""
    rng = np.random.default_rng(0)
    out: dict[str, list[dict]] = {"padded": [], "unpadded": []}
    for k in range(batches):
        rows = []
        for n in lengths_of(profile, PROFILES[profile][1], rng):
            ids = rng.integers(5, VOCAB_SIZE, n)
            ids[0], ids[-1] = data.vocab.cls_id, data.vocab.sep_id
            rows.append({"input_ids": ids, "a_len": max(1, n // 2), "next_sentence_label": int(rng.integers(0, 2))})
        for layout in out:
            batch = Collator(data, unpadded=layout == "unpadded")(rows, np.random.default_rng([k, 1]))
            batch["real_tokens"] = real_tokens(batch)
            out[layout].append({key: v.to(device) if torch.is_tensor(v) else v for key, v in batch.items()})
    return out


def step_seconds(model: torch.nn.Module, batch: dict[str, Any], device: torch.device) -> float:
    inputs = {key: value for key, value in batch.items() if key != "real_tokens"}
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(**inputs).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_profile(profile: str, args: argparse.Namespace, data: PhaseData, device: torch.device) -> None:
    seq = PROFILES[profile][0]
    layouts = micro_batches(data, profile, args.batches, device)
    torch.manual_seed(0)
    eager = build_model(bert_config(args.preset, VOCAB_SIZE)).to(device)
    compiled = build_model(bert_config(args.preset, VOCAB_SIZE)).to(device)
    compiled.load_state_dict(eager.state_dict())
    compile_layers(compiled, strict=True)  # a benchmark of the compiled layer: a layer that falls back is an error
    paths = {"padded eager": (eager, "padded"), "unpadded eager": (eager, "unpadded"),
             "unpadded compiled": (compiled, "unpadded")}
    before, started = compile_seconds(), time.perf_counter()
    for batch in layouts["unpadded"]:  # every token count once: what compiling costs before steady state
        step_seconds(compiled, batch, device)
    first_pass, compile_s = time.perf_counter() - started, compile_seconds() - before
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name, (model, layout) in paths.items():
            for batch in layouts[layout]:
                seconds = step_seconds(model, batch, device)
                if rep:
                    times[name].append(seconds)
    tokens = statistics.mean(b["real_tokens"] for b in layouts["padded"])
    padding = 1 - tokens / (PROFILES[profile][1] * seq)
    print(f"\n{profile}: {args.preset}, seq {seq}, {PROFILES[profile][1]} instances per micro-batch, "
          f"{padding:.1%} padding, {device}")
    print("| path | ms / micro-batch | real tokens/s | vs padded eager |\n|---|---|---|---|")
    base = statistics.median(times["padded eager"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.0f} | {tokens / median:,.0f} | {base / median:.2f}x |")
    print(f"compile: {compile_s:.1f} s reported by torch; first pass over {args.batches} micro-batches "
          f"{first_pass:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bert-mini")
    parser.add_argument("--phases", default="p1,p2", help="comma-separated: p1, p2")
    parser.add_argument("--batches", type=int, default=4, help="micro-batches per path and repetition")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as folder:
        vocab = synthetic_vocab(Path(folder))
    for profile in args.phases.split(","):
        if profile not in PROFILES:
            parser.error(f"--phases: unknown {profile!r}; choose from {sorted(PROFILES)}")
        seq = PROFILES[profile][0]
        data = PhaseData(manifest=None, vocab=vocab, seq_len=seq, max_predictions=max(2, seq * 15 // 100 + 1),
                         mask_prob=0.15, whole_word=False)  # type: ignore[arg-type] - no shards behind it
        run_profile(profile, args, data, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
