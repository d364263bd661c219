"""The corpus of tests/data_prep/test_input_shards.py and what its tests share: three `--text` files of disjoint
words, each an input shard of its own, the folder seeded with small shuffle buckets, and ways to run and read a
build."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from data_prep.keyed_order import ORDER_KEYED
from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.shard_format.shards import Manifest
from tests.support.paths import REPO_ROOT

GROUPS = 3
SEQ_LENS = ("32", "64")
BUCKET = 50


def word(group: int, index: int) -> str:
    return f"w{group}x{index}"


def write_corpus(root: Path, documents: int = 40) -> list[str]:
    """Three sentence-per-line files (blank line between documents) and a vocab of their words."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(11)
    flags = []
    for group in range(GROUPS):
        lines = []
        for _ in range(documents):
            for _ in range(rng.randint(3, 9)):
                lines.append(" ".join(word(group, rng.randrange(30)) for _ in range(rng.randint(4, 12))) + " .")
            lines.append("")
        (root / f"part{group}.txt").write_text("\n".join(lines), encoding="utf-8")
        flags += ["--text", str(root / f"part{group}.txt")]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."]
    tokens += [word(g, i) for g in range(GROUPS) for i in range(30)]
    (root / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    # Each file one input shard: a budget above every file (so none is cut) and below any two together.
    budget = max((root / f"part{g}.txt").stat().st_size for g in range(GROUPS)) * 1.2 / (1 << 20)
    return [*flags, "--vocab", str(root / "vocab.txt"), "--input-shard-mb", f"{budget:.6f}", "--seq-lens", ",".join(SEQ_LENS),
            "--num-shards", "3", "--val-fraction", "0.1", "--docs-per-chunk", "8", "--seed", "5",
            "--keep-work"]  # the tests read work/; test_every_executor_gives_the_same_bytes builds without it


def seed_folder(out: Path, identity: Path, order: str | None = ORDER_KEYED) -> None:
    """The folder as a started build leaves it (its config), with small shuffle buckets recorded: in the keyed
    order (its bucket count then derived by the first instance task), or without an order (None: the scatter
    order's record, as the version before the keyed order wrote it at its shard stage)."""
    out.mkdir(parents=True)
    (out / "build_config.json").write_bytes(identity.read_bytes())
    record = {"bucket_instances": BUCKET} if order is None else {"order": order, "bucket_instances": BUCKET}
    for seq_len in SEQ_LENS:
        atomic_write_json(out / "work" / "shards" / f"seq{seq_len}-train-order.json", record)


def python_m(*args: str) -> list[str]:
    return [sys.executable, "-m", "data_prep", *args]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, **kwargs)


def shard_digests(out: Path) -> dict[str, str]:
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    return {s["file"]: s["sha256"] for entry in manifest["seq_lens"].values() for split in entry.values()
            for s in split["shards"]}


def shard_of_tokens(ids: list[int]) -> set[int]:
    """The input shards (word groups) an instance's words come from: ids 6.. are group-major, 30 a group."""
    return {(i - 6) // 30 for i in ids if i >= 6}


def rows(out: Path, seq_len: str, split: str = "train") -> dict[str, list]:
    manifest = Manifest.load(out)
    tables = [ipc.open_file(pa.memory_map(str(out / s.file), "r")).read_all() for s in manifest.shards(int(seq_len), split)]
    return pa.concat_tables(tables).to_pydict()


def wait_for_jobs(slurm, out: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not slurm.command("squeue", "-h").strip():
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-800:] for p in sorted((out / "work" / "slurm").glob("*.log")))
    pytest.fail(f"SLURM jobs still queued after {timeout} s:\n{slurm.command('squeue')}\n{logs}")


def submit(slurm, flags: list[str], out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **slurm.env}
    return subprocess.run(python_m("build", *flags, "--out", str(out), "--workers", "1", "--slurm", *extra),
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
