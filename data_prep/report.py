"""Human-facing output: the summary table after a build, and `python -m data_prep inspect OUT`."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data_prep.config import NSP
from data_prep.shard_format.shards import Manifest, ShardReader
from data_prep.shard_format.vocab import load_vocab


def _table(header: Sequence[str], rows: list[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_text(manifest: dict[str, Any], seconds: float | None = None) -> str:
    totals = manifest["totals"]
    lines = [
        "corpus: " + ", ".join(f"{k}={v:,}" for k, v in totals.items()),
        f"vocab: {manifest['vocab']['size']:,} tokens, lowercase={manifest['vocab']['lowercase']}, "
        f"sha256 {manifest['vocab']['sha256'][:12]}",
        f"segments: {manifest.get('segments', NSP)}, masking: {manifest['masking']['mode']} "
        f"(mask_prob {manifest['masking']['mask_prob']}), seed {manifest['seed']}",
    ]
    by_length = sorted(manifest["seq_lens"].items(), key=lambda kv: int(kv[0]))
    # Packed modes: the short pieces of over-long sentences that no sentence joined (data_prep/instances.py).
    dropped = any("pieces_dropped_short" in entry for _, by_split in by_length for entry in by_split.values())
    header = ["seq_len", "split", "shards", "instances", "per shard", "nsp random"]
    header += ["short pieces dropped"] if dropped else []
    rows = []
    for seq_len, by_split in by_length:
        for split, entry in by_split.items():
            counts = [s["num_instances"] for s in entry["shards"]]
            nsp = entry["nsp_random_fraction"]
            rows.append([
                seq_len, split, len(counts), f"{entry['num_instances']:,}",
                f"{min(counts)}..{max(counts)}" if counts else "-",
                f"{nsp:.3f}" if nsp is not None else "-",
            ])
            if dropped:
                rows[-1].append(f"{entry['pieces_dropped_short']:,} ({entry['tokens_dropped_short']:,} tokens)")
    lines.append(_table(header, rows))
    if seconds is not None:
        tokens = totals.get("tokens", 0)
        lines.append(f"time: {seconds:.1f}s ({tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    return "\n".join(lines)


def print_summary(manifest: dict[str, Any], seconds: float | None = None) -> None:
    print(summary_text(manifest, seconds), flush=True)


def decode(tokens: Sequence[str], ids: Sequence[int], masked: dict[int, int] | None = None) -> str:
    """WordPiece ids -> readable text; masked positions shown as [MASK->original] style markers."""
    pieces = []
    for pos, token_id in enumerate(ids):
        piece = tokens[token_id]
        if masked and pos in masked:
            piece = f"<{piece}|{tokens[masked[pos]]}>"
        pieces.append(piece)
    return " ".join(pieces).replace(" ##", "")


def inspect_text(out: Path, num_examples: int = 3, seed: int = 0) -> str:
    manifest = Manifest.load(out)
    vocab = load_vocab(manifest.vocab_path)
    lines = [summary_text(manifest.data)]
    rng = random.Random(seed)
    for seq_len in manifest.seq_lens:
        reader = ShardReader(manifest, seq_len, "train")
        if len(reader) == 0:
            continue
        for index in sorted(rng.sample(range(len(reader)), min(num_examples, len(reader)))):
            row = reader[index]
            masked = None
            if "masked_positions" in row:
                masked = dict(zip(row["masked_positions"].tolist(), row["masked_label_ids"].tolist(), strict=True))
            if manifest.next_sentence_labels:
                label = "random next" if row["next_sentence_label"] else "is next"
                shape = f"A={row['a_len']}, {label}"
            else:
                shape = "one segment, no NSP label"
            lines.append(f"\n[seq {seq_len} #{index}] {len(row['input_ids'])} tokens, {shape}")
            lines.append(decode(vocab.tokens, row["input_ids"].tolist(), masked))
    return "\n".join(lines)
