"""Benchmark: what rank 0's value check adds to the start-up hashing of the shards it rides on.

    python bench/shard_checks.py [SHARDS_DIR --seq-len 128] [--instances 200000] [--reps 3]

With SHARDS_DIR: every training shard of that folder at `--seq-len`. Without: one synthetic static-masked shard
of `--instances` instances at seq 128 (random lengths 64..128, 15 % positions, a 30,522-token vocab), written by
the shard writer in a temporary folder. Times the old check (sha256 of each file, data_prep.shard_format.atomic_io.sha256_file)
against the new one (pretrain/data/shard_values.py check_shard: one memory-mapped read, hashed, then every id and
masked position checked by pyarrow.compute), best of `--reps` with the files in the page cache, and prints both
and their ratio. One process, CPU only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.shard_format.atomic_io import sha256_file  # noqa: E402
from data_prep.shard_format.shards import Manifest, ShardInfo, shard_schema, write_shard_table  # noqa: E402
from pretrain.data.shard_values import ValueLimits, check_shard  # noqa: E402

BERT_VOCAB = 30522


def synthetic_shard(path: Path, instances: int, seq_len: int = 128, seed: int = 0) -> ShardInfo:
    """One static-masked shard of random instances, as data_prep lays it out (one record batch)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq_len // 2, seq_len + 1, instances)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(0, BERT_VOCAB, int(offsets[-1])).astype(np.uint16)
    picks = np.maximum(1, lengths * 15 // 100)
    pick_offsets = np.concatenate([[0], np.cumsum(picks)]).astype(np.int32)
    positions = (rng.random(int(pick_offsets[-1])) * np.repeat(lengths, picks)).astype(np.uint16)
    labels = rng.integers(0, BERT_VOCAB, int(pick_offsets[-1])).astype(np.uint16)
    columns = [pa.ListArray.from_arrays(offsets, ids), pa.array(lengths // 2, pa.uint16()),
               pa.array(np.zeros(instances, np.int8)), pa.ListArray.from_arrays(pick_offsets, positions),
               pa.ListArray.from_arrays(pick_offsets, labels)]
    table = pa.Table.from_arrays(columns, schema=shard_schema(BERT_VOCAB, static_masking=True))
    rows, sha = write_shard_table(path, table)
    return ShardInfo(path.name, rows, sha)


def best_of(reps: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shards", type=Path, nargs="?")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--instances", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        if args.shards is not None:
            manifest = Manifest.load(args.shards)
            root, infos, vocab = manifest.root, manifest.shards(args.seq_len), manifest.vocab_size
        else:
            root, infos, vocab = Path(scratch), [synthetic_shard(Path(scratch) / "train-00000.arrow",
                                                                 args.instances, args.seq_len)], BERT_VOCAB
        limits = ValueLimits(vocab_size=vocab, seq_len=args.seq_len)
        size = sum((root / info.file).stat().st_size for info in infos)
        hashed = best_of(args.reps, lambda: [sha256_file(root / info.file) for info in infos])
        checked = best_of(args.reps, lambda: [check_shard(root / info.file, info.sha256, limits) for info in infos])
    print(f"{len(infos)} shard(s), {size / 2**20:.1f} MiB, page cache warm, best of {args.reps}")
    print(f"sha256 only (before):        {hashed:.3f} s  ({size / 2**30 / hashed:.2f} GiB/s)")
    print(f"sha256 + values (now):       {checked:.3f} s  ({size / 2**30 / checked:.2f} GiB/s)")
    print(f"ratio now / before:          {checked / hashed:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
