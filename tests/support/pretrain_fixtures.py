"""Tiny, learnable pretraining shards and run configs for the pretrain tests (no network, no hub).

Instances follow a rule a tiny BERT learns in a few dozen steps (each token is the previous one
plus one, modulo a small alphabet), so "the MLM loss falls" is a real check, not noise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.config import NSP
from data_prep.shard_format.atomic_io import atomic_write_json, sha256_file
from data_prep.shard_format.shards import FORMAT_NAME, FORMAT_VERSION, NO_NEXT_SENTENCE_LABEL, write_shard
from tests.support.paths import REPO_ROOT, SCRIPTS

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ALPHABET = 40  # word tokens w0..w39, ids 5..44; "##x" pieces make whole-word masking testable


def write_vocab(path: Path) -> list[str]:
    tokens = SPECIALS + [f"w{i}" for i in range(ALPHABET)] + ["##a", "##b", "##c"]
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return tokens


def make_instance(rng: np.random.Generator, seq_len: int, pairs: bool = True) -> dict[str, Any]:
    """A sentence pair `[CLS] A [SEP] B [SEP]` with a random next-sentence label, or (not `pairs`) one packed
    segment `[CLS] words [SEP]` with no label (NO_NEXT_SENTENCE_LABEL), as data_prep's packed modes write."""
    length = int(rng.integers(seq_len // 2, seq_len + 1))
    start = int(rng.integers(0, ALPHABET))
    if not pairs:
        words = [(start + i) % ALPHABET + len(SPECIALS) for i in range(length - 2)]
        return {"input_ids": [2, *words, 3], "a_len": length, "next_sentence_label": NO_NEXT_SENTENCE_LABEL}
    a_len = int(rng.integers(2, length - 2))
    words = [(start + i) % ALPHABET + len(SPECIALS) for i in range(length - 3)]
    ids = [2] + words[: a_len - 2] + [3] + words[a_len - 2 :] + [3]
    return {"input_ids": ids, "a_len": a_len, "next_sentence_label": int(rng.integers(0, 2))}


def build_shards(out: Path, seq_lens: tuple[int, ...] = (32, 64), train: int = 96, val: int = 16,
                 shards_per_split: int = 2, seed: int = 0, segments: str = NSP) -> Path:
    """A data_prep-format folder with dynamic masking at each sequence length; `segments` as data_prep --segments
    (nsp: sentence pairs for MLM + NSP; full-sentences / doc-sentences: packed segments for MLM alone)."""
    out.mkdir(parents=True, exist_ok=True)
    tokens = write_vocab(out / "vocab.txt")
    rng = np.random.default_rng(seed)
    by_len: dict[str, Any] = {}
    for seq_len in seq_lens:
        entry: dict[str, Any] = {}
        for split, count in (("train", train), ("val", val)):
            shards = []
            per = count // shards_per_split
            for index in range(shards_per_split):
                rows = [make_instance(rng, seq_len, pairs=segments == NSP) for _ in range(per)]
                rel = f"seq{seq_len}/{split}-{index:05d}.arrow"
                n, sha = write_shard(out / rel, rows, len(tokens), static_masking=False)
                shards.append({"file": rel, "num_instances": n, "sha256": sha})
            entry[split] = {"num_instances": per * shards_per_split, "shards": shards,
                            "nsp_random_fraction": 0.5 if segments == NSP else None}
        by_len[str(seq_len)] = entry
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tool_version": "test",
        "vocab": {"file": "vocab.txt", "sha256": sha256_file(out / "vocab.txt"), "size": len(tokens), "lowercase": True},
        "masking": {"mode": "dynamic", "mask_prob": 0.15, "whole_word": False, "dupe_factor": 1,
                    "max_predictions": {str(s): max(2, s * 15 // 100 + 1) for s in seq_lens}},
        "seed": seed, "config": {}, "totals": {}, "seq_lens": by_len, "segments": segments,
    }
    atomic_write_json(out / "manifest.json", manifest)
    return out


def short_instances_at_64(shards: Path, out: Path) -> Path:
    """The seq-32 shards relabelled as seq 64: a phase-2-like set where most rows are half padding."""
    shutil.copytree(shards, out)
    (out / "seq32").rename(out / "seq64")
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["seq_lens"].pop("32")
    for split in entry.values():
        for shard in split["shards"]:
            shard["file"] = shard["file"].replace("seq32/", "seq64/")
    manifest["seq_lens"]["64"] = entry
    manifest["masking"]["max_predictions"] = {"64": 10}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def tiny_run_config(path: Path, shards: Path, run_dir: Path, **phase_steps: int) -> Path:
    """A RUN.json for a 2-phase tiny run on CPU (seq 32 then 64) with ZeRO-2 + ExactLamb, micro-batch 4 x 2
    accumulation per rank (the global batch follows the number of ranks)."""
    ds = str(REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json")
    config = {
        "run": {"dir": str(run_dir), "seed": 7},
        "model": {"preset": "tiny"},
        "data": {"shards": str(shards), "num_workers": 0},
        "phase1": {"seq_len": 32, "ds_config": ds, "steps": phase_steps.get("phase1", 6), "warmup_fraction": 0.3,
                   "lr": 5e-3, "micro_batch_size": 4, "gradient_accumulation_steps": 2},
        "phase2": {"seq_len": 64, "ds_config": ds, "steps": phase_steps.get("phase2", 4), "warmup_fraction": 0.25,
                   "lr": 3e-3, "micro_batch_size": 4, "gradient_accumulation_steps": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 2},
        "logging": {"progress_bar": False, "val_every_steps": 3, "val_batches": 2, "peak_tflops": 1.0},
    }
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


PRETRAIN_SCENARIOS = SCRIPTS / "pretrain_scenarios.py"


def step_records(run_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The last logged record of each (phase, step) in a run's metrics.jsonl (a resumed step's record
    replaces the one logged before the stop)."""
    records = {}
    for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "phase" in record:
            records[(record["phase"], record["phase_step"])] = record
    return records
