"""Whole corpus tasks, W at a time (data_prep/corpus_stage.py): a worker reads, cleans and tokenizes an input shard
on its own, so two workers run two input shards at once (their task times, recorded in the markers, overlap), a
SLURM corpus element takes a block of --workers shards, and tokenizing in sub-batches of text gives the ids of one
batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from data_prep.__main__ import main
from data_prep.corpus_stage import _tokenizer, sub_batches, tokenize_batch
from data_prep.work_layout import CLEAN_STAGE, TOKENS_STAGE, marker_path
from tests.support.data_prep_fixtures import write_sentence_file, write_vocab

SHARDS = 2


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    """Two --text files, each an input shard of its own, large enough (~0.3 MB) that a task outlasts a worker's
    start-up, so that the second worker is ready while the first still runs."""
    root = tmp_path_factory.mktemp("corpus_tasks")
    flags = []
    for index in range(SHARDS):
        write_sentence_file(root / f"part{index}.txt", documents=500, seed=index)
        flags += ["--text", str(root / f"part{index}.txt")]
    write_vocab(root / "vocab.txt")
    budget = max((root / f"part{i}.txt").stat().st_size for i in range(SHARDS)) * 1.2 / (1 << 20)
    return [*flags, "--vocab", str(root / "vocab.txt"), "--input-shard-mb", f"{budget:.6f}", "--seq-lens", "64",
            "--num-shards", "2", "--seed", "3"]


def task_span(out: Path, shard: int) -> tuple[int, float, float]:
    """(pid, start, end) of shard's corpus task: its clean part's start to its tokenize part's end."""
    clean = json.loads(marker_path(out, CLEAN_STAGE, shard).read_text(encoding="utf-8"))["ran"]
    tokens = json.loads(marker_path(out, TOKENS_STAGE, shard).read_text(encoding="utf-8"))["ran"]
    assert clean["pid"] == tokens["pid"]  # one process read, cleaned and tokenized the shard
    return clean["pid"], clean["started"], tokens["ended"]


def test_two_workers_run_two_input_shards_at_once(inputs: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["build", *inputs, "--out", str(out), "--workers", "2", "--keep-work"]) == 0
    assert len(json.loads((out / "work" / "plan.json").read_text(encoding="utf-8"))["shards"]) == SHARDS
    (pid_a, start_a, end_a), (pid_b, start_b, end_b) = (task_span(out, s) for s in range(SHARDS))
    assert os.getpid() not in (pid_a, pid_b)  # the main process read no document
    assert pid_a != pid_b
    assert start_a < end_b and start_b < end_a, "the two corpus tasks did not overlap"


def test_a_slurm_corpus_element_takes_a_block_of_workers_shards(inputs: list[str], tmp_path: Path, capsys) -> None:
    """--workers 2: one corpus element per two input shards, each running them as corpus tasks (printed only)."""
    out = tmp_path / "out"
    assert main(["build", *inputs, "--out", str(out), "--workers", "2", "--slurm", "--print-sbatch"]) == 0
    printed = capsys.readouterr().out
    assert "#SBATCH --array=0\n" in printed
    assert "task corpus --out" in printed and "--index $((INDEX * 2)) --count 2 --workers 2" in printed


def test_sub_batches_give_the_ids_of_one_batch(tmp_path: Path) -> None:
    """Tokenized ~1 MB of text at a time: the same table whatever the cut, down to one sentence per call; a
    sentence longer than the limit is a sub-batch alone, and no sentence is left out or taken twice."""
    write_vocab(tmp_path / "vocab.txt")
    tokenizer = _tokenizer(str(tmp_path / "vocab.txt"), True)
    write_sentence_file(tmp_path / "t.txt", documents=40, seed=9)
    docs = [d.split("\n") for d in (tmp_path / "t.txt").read_text(encoding="utf-8").strip().split("\n\n")]
    docs[3] = ["", *docs[3], "", "river " * 3000]  # empty sentences are dropped, a long one stands alone
    table = pa.table({"title": [f"d{i}" for i in range(len(docs))], "sentences": docs})
    whole, stats = tokenize_batch(table, tokenizer, 100, limit=1 << 30)
    for limit in (1, 300, 5000):
        cut, cut_stats = tokenize_batch(table, tokenizer, 100, limit=limit)
        assert cut.equals(whole) and cut_stats == stats, limit
    offsets = [0, 10, 20, 5000, 5010]
    assert sub_batches(np.array(offsets), limit=15) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stats["sentences"] == sum(len([s for s in d if s]) for d in docs)
