"""Synthetic training shards for bench/gpu_check/run.py, in the data_prep format, with the lengths real data has.

The training rows read these through the real `pretrain.data.batches.RankBatches` and the driver's DataLoader, so
the check pays for reading, dynamic masking and collation as a run does. Token ids are random (the
content does not change the speed); what matters is the length of each instance, which decides the
padding of a batch, and with it which attention path runs:

- "padded": BERT's instance builder (data_prep/instances.py) picks a random shorter target length with
  `short_seq_prob` 0.1 and otherwise fills the row. So 10 % of the instances here get a random length
  in [5, seq_len), the rest are full. A micro-batch of 64 then almost always holds a short row
  (P(none) = 0.9^64 ~ 0.1 %), so transformers builds the attention mask and SDPA runs its masked
  kernel, as in production.
- "full": every instance full length: no padding, so transformers drops the mask and SDPA may take its
  flash kernel. Not what real data gives; the row shows what the mask costs.
- "varied": lengths uniform in [seq_len/4, seq_len] (~37 % padding in expectation), data where phase-2
  packing has something to pack; the unpacked and packed rows read the same shards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from data_prep.shard_format.atomic_io import atomic_write_json, sha256_file
from data_prep.shard_format.shards import FORMAT_NAME, FORMAT_VERSION, write_shard

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CLS, SEP = 2, 3


@dataclass(frozen=True)
class LengthProfile:
    """How long the instances of a synthetic shard are (see the module docstring)."""

    name: str
    short_fraction: float  # share of instances given a random length in [min_length, seq_len)
    min_length_fraction: float  # shortest random length as a fraction of seq_len (at least 5 tokens)

    def lengths(self, count: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
        shortest = max(5, int(seq_len * self.min_length_fraction))
        lengths = np.full(count, seq_len, dtype=np.int64)
        short = rng.random(count) < self.short_fraction
        lengths[short] = rng.integers(shortest, seq_len, int(short.sum()))
        return lengths


PROFILES = {
    "padded": LengthProfile("padded", short_fraction=0.1, min_length_fraction=0.0),
    "full": LengthProfile("full", short_fraction=0.0, min_length_fraction=0.0),
    "varied": LengthProfile("varied", short_fraction=1.0, min_length_fraction=0.25),
}


def max_predictions(seq_len: int) -> int:
    """MLM slots per instance: 15 % of the length (BERT's 20 at 128, 77 vs its 80 at 512)."""
    return max(1, round(0.15 * seq_len))


def write_vocab(path: Path, vocab_size: int) -> None:
    tokens = SPECIAL_TOKENS + [f"t{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")


def synthetic_shards(out: Path, vocab_size: int, seq_len: int, count: int, profile: LengthProfile,
                     seed: int = 0) -> Path:
    """One training shard of `count` random-token instances (dynamic masking) at `seq_len`, its vocab and
    manifest: a folder `open_phase_data` accepts. The same arguments write the same bytes."""
    out.mkdir(parents=True, exist_ok=True)
    write_vocab(out / "vocab.txt", vocab_size)
    rng = np.random.default_rng([seed, seq_len, count])
    rows = []
    for length in profile.lengths(count, seq_len, rng):
        body = rng.integers(len(SPECIAL_TOKENS), vocab_size, int(length) - 3).tolist()
        a_len = max(3, int(length) // 2)  # [CLS] A [SEP]: at least one token in A and in B
        rows.append({"input_ids": [CLS, *body[: a_len - 2], SEP, *body[a_len - 2:], SEP], "a_len": a_len,
                     "next_sentence_label": int(rng.integers(0, 2))})
    shard = f"seq{seq_len}/train-00000.arrow"
    n, sha = write_shard(out / shard, rows, vocab_size, static_masking=False)
    atomic_write_json(out / "manifest.json", {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tool_version": "gpu_check",
        "vocab": {"file": "vocab.txt", "sha256": sha256_file(out / "vocab.txt"), "size": vocab_size,
                  "lowercase": True},
        "masking": {"mode": "dynamic", "mask_prob": 0.15, "whole_word": False, "dupe_factor": 1,
                    "max_predictions": {str(seq_len): max_predictions(seq_len)}},
        "seed": seed, "config": {"profile": profile.name}, "totals": {},
        "seq_lens": {str(seq_len): {"train": {"num_instances": n, "shards": [
            {"file": shard, "num_instances": n, "sha256": sha}]}}},
    })
    return out


class ShardCache:
    """One folder per (seq_len, profile) under `root`, written on first use and shared by the rows."""

    def __init__(self, root: Path, vocab_size: int, count: int, smoke: bool = False) -> None:
        self.root, self.vocab_size, self.count = root, vocab_size, count
        self.made: dict[tuple[int, str, int], Path] = {}
        # --smoke reads 8-32 instances a row: at BERT's 10 % a padded row could hold no short one and measure no
        # padding (whether it does would hang on the training order); at half it holds some, whatever the order.
        self.profiles = {**PROFILES, "padded": replace(PROFILES["padded"], short_fraction=0.5)} \
            if smoke else PROFILES

    def get(self, seq_len: int, profile: str, micro_batch: int) -> Path:
        count = max(self.count, 4 * micro_batch)  # RankBatches needs one micro-batch; epochs repeat the rest
        key = (seq_len, profile, count)
        if key not in self.made:
            self.made[key] = synthetic_shards(self.root / f"seq{seq_len}-{profile}-{count}", self.vocab_size,
                                              seq_len, count, self.profiles[profile])
        return self.made[key]
