"""End-to-end `python -m data_prep` on inputs the tests write: invariants, determinism, resume, errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_prep.__main__ import main
from tests.support.data_prep_fixtures import (
    check_output,
    tree_digest,
    write_books,
    write_sentence_file,
    write_vocab,
    write_wiki_dump,
)
from tests.support.paths import REPO_ROOT


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    write_wiki_dump(root / "dump.xml.bz2", articles=10)
    write_books(root / "books", books=3)
    write_sentence_file(root / "corpus.txt", documents=30)
    write_vocab(root / "vocab.txt")
    return {
        "dump": root / "dump.xml.bz2", "books": root / "books", "text": root / "corpus.txt",
        "vocab": root / "vocab.txt", "root": root,
    }


def all_sources(inputs: dict[str, Path]) -> list[str]:
    return ["--wiki-dump", str(inputs["dump"]), "--books", str(inputs["books"]), "--text", str(inputs["text"])]


def build(out: Path, *flags: str) -> int:
    return main(["build", "--out", str(out), "--seed", "7", *flags])


def test_static_whole_word_build_holds_every_invariant(inputs, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    flags = [*all_sources(inputs), "--vocab-size", "120", "--seq-lens", "64,128", "--masking", "static",
             "--whole-word", "--dupe-factor", "2", "--val-fraction", "0.2", "--num-shards", "3", "--workers", "1",
             "--docs-per-chunk", "8", "--min-doc-chars", "200"]
    assert build(out, *flags) == 0
    manifest = check_output(out, min_instances=50)
    data = manifest.data
    assert data["masking"] == {"mode": "static", "mask_prob": 0.15, "whole_word": True, "dupe_factor": 2,
                               "max_predictions": {"64": 10, "128": 20}}
    totals = data["totals"]
    # 10 articles + 3 books + 30 text documents; redirects, disambiguation, talk and template pages gone.
    assert totals["input_documents"] == 43
    assert totals["documents"] + totals["documents_dropped_short"] == 43
    assert 0 < totals["val_documents"] < totals["documents"]
    assert data["seq_lens"]["64"]["val"]["num_instances"] > 0
    assert manifest.vocab_size == 120 and len(manifest.shards(64)) == 3
    summary = capsys.readouterr().out
    assert "nsp random" in summary and "seq_len" in summary
    # A second run finds the finished folder and changes nothing.
    before = tree_digest(out)
    assert build(out, *flags) == 0
    assert tree_digest(out) == before
    assert "already complete" in capsys.readouterr().out
    assert main(["inspect", str(out), "--num-examples", "2"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("[seq 64 #") == 2 and "[CLS]" in shown and "<" in shown  # masked tokens marked


def test_one_and_two_workers_give_identical_bytes(inputs, tmp_path) -> None:
    # A given vocab: `tokenizers`' WordPiece trainer breaks count ties in hash-map order, so a
    # *trained* vocab can differ between runs on tiny synthetic corpora (see docs/data_prep.md).
    flags = [*all_sources(inputs), "--vocab", str(inputs["vocab"]), "--seq-lens", "64", "--val-fraction", "0.1",
             "--num-shards", "4", "--docs-per-chunk", "5"]
    assert build(tmp_path / "one", *flags, "--workers", "1") == 0
    assert build(tmp_path / "two", *flags, "--workers", "2") == 0
    one, two = tree_digest(tmp_path / "one"), tree_digest(tmp_path / "two")
    assert len(one) == 4 + 1 + 2 and one == two  # 4 train + 1 val shard, vocab, manifest


def test_node_builds_then_merge_equal_single_node(inputs, tmp_path) -> None:
    flags = [*all_sources(inputs), "--vocab", str(inputs["vocab"]), "--seq-lens", "48", "--num-shards", "2",
             "--docs-per-chunk", "4", "--workers", "1"]
    assert build(tmp_path / "single", *flags) == 0
    shared = tmp_path / "multi"
    for rank in (1, 0):  # any order
        assert build(shared, *flags, "--num-nodes", "2", "--node-rank", str(rank), "--node-wait", "0") == 0
        assert not (shared / "manifest.json").exists()
    assert main(["merge", "--out", str(shared), "--workers", "1"]) == 0
    check_output(shared)
    assert tree_digest(shared) == tree_digest(tmp_path / "single")


def test_resume_after_sigkill_gives_identical_output(tmp_path) -> None:
    """Three dumps, each an input shard of its own: killed once shard 1 is cleaned, the same command keeps the
    finished shards (their markers and files untouched), runs the rest and equals an uninterrupted build."""
    dumps = []
    for index in range(3):
        write_wiki_dump(tmp_path / f"dump{index}.xml", articles=150, seed=5 + index)
        dumps += ["--wiki-dump", str(tmp_path / f"dump{index}.xml")]
    write_vocab(tmp_path / "vocab.txt")
    flags = [*dumps, "--vocab", str(tmp_path / "vocab.txt"), "--input-shard-mb", "0.0001",
             "--seq-lens", "64", "--num-shards", "2", "--docs-per-chunk", "10", "--workers", "1", "--seed", "3",
             "--keep-work"]  # the relaunch's reuse of finished files is checked after it
    command = [sys.executable, "-m", "data_prep", "build", *flags]
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([*command, "--out", str(out)], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = out / "work" / "done" / "clean-00001.json"
    deadline = time.monotonic() + 60
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the build finished before it could be killed"
    assert not (out / "manifest.json").exists()
    finished = {p: p.stat().st_mtime_ns for p in [marker, out / "work" / "text" / "shard-00001.arrow",
                                                 out / "work" / "done" / "clean-00000.json"]}
    (out / "work" / "text" / ".shard-00002.arrow.x1.tmp").write_bytes(b"half a file")  # as a kill leaves it
    # Same command again: continues (keeps the finished shards) and completes.
    assert subprocess.run([*command, "--out", str(out)], cwd=REPO_ROOT, env=env, capture_output=True).returncode == 0
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # reused, not redone
    assert build(tmp_path / "fresh", *flags) == 0
    assert tree_digest(out) == tree_digest(tmp_path / "fresh")
    assert not list(out.rglob("*.tmp"))


def test_hugging_face_datasets_saved_locally(tmp_path) -> None:
    import datasets

    write_vocab(tmp_path / "vocab.txt")
    write_sentence_file(tmp_path / "corpus.txt", documents=20)
    texts = (tmp_path / "corpus.txt").read_text(encoding="utf-8").strip().split("\n\n")
    rows = {"title": [f"Doc {i}" for i in range(len(texts))], "text": [t.replace("\n", " ") for t in texts]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    # A folder of parquet files goes through datasets.load_dataset (streaming), like a Hub name does.
    (tmp_path / "hub_like").mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "hub_like" / "train.parquet"))
    for source in ("saved", "hub_like"):
        out = tmp_path / f"out_{source}"
        flags = ["--hf-dataset", str(tmp_path / source), "--vocab", str(tmp_path / "vocab.txt"),
                 "--seq-lens", "64", "--num-shards", "2", "--workers", "1"]
        assert build(out, *flags) == 0
        manifest = check_output(out)
        assert manifest.data["totals"]["documents"] == 20
    assert tree_digest(tmp_path / "out_saved")["seq64/train-00000.arrow"] != ""


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", r"--text .*nothing.txt: no such file"),
        ("corrupt_bz2", r"--wiki-dump .*broken.xml.bz2: corrupt"),
        ("not_utf8", r"--books .*latin1.txt: not UTF-8"),
        ("empty", r"empty corpus"),
        ("bad_vocab", r"--vocab .*bad_vocab.txt: lacks the special token\(s\) \[MASK\]"),
        ("other_config", r"--out .*: holds shards of a different config \(seed: 7 -> 8\)"),
        ("too_many_shards", r"--num-shards 100000: only \d+ train instances at sequence length 64"),
        ("no_vocab", r"give exactly one of --vocab FILE or --vocab-size N"),
    ],
)
def test_bad_input_is_named(case: str, message: str, inputs, tmp_path, capsys) -> None:
    vocab = ["--vocab", str(inputs["vocab"])]
    text = ["--text", str(inputs["text"])]
    out = tmp_path / "out"
    if case == "missing":
        flags = ["--text", str(tmp_path / "nothing.txt"), *vocab]
    elif case == "corrupt_bz2":
        (tmp_path / "broken.xml.bz2").write_bytes(b"BZh91AY&SY" + os.urandom(300))
        flags = ["--wiki-dump", str(tmp_path / "broken.xml.bz2"), *vocab]
    elif case == "not_utf8":
        (tmp_path / "books").mkdir()
        (tmp_path / "books" / "latin1.txt").write_bytes("Bruneti\u00e8re wrote.\n".encode("latin-1"))
        flags = ["--books", str(tmp_path / "books"), *vocab]
    elif case == "empty":
        (tmp_path / "blank.txt").write_text("\n\n\n", encoding="utf-8")
        flags = ["--text", str(tmp_path / "blank.txt"), *vocab]
    elif case == "bad_vocab":
        (tmp_path / "bad_vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n", encoding="utf-8")
        flags = [*text, "--vocab", str(tmp_path / "bad_vocab.txt")]
    elif case == "other_config":
        assert build(out, *text, *vocab, "--seq-lens", "64", "--num-shards", "1", "--workers", "1") == 0
        flags = [*text, *vocab, "--seq-lens", "64", "--num-shards", "1", "--seed", "8"]
    elif case == "too_many_shards":
        flags = [*text, *vocab, "--seq-lens", "64", "--num-shards", "100000"]
    else:
        flags = text
    capsys.readouterr()
    assert build(out, *flags, "--workers", "1") == 2
    err = capsys.readouterr().err
    error_line = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(error_line) == 1 and re.search(message, error_line[0]), err
    if case != "other_config":
        assert not (out / "manifest.json").exists()


def test_help_explains_every_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "data_prep", "build", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True)
    for flag in ("--wiki-dump", "--wikiextractor", "--books", "--text", "--hf-dataset", "--vocab", "--vocab-size",
                 "--seq-lens", "--segments", "--masking", "--mask-prob", "--dupe-factor", "--val-fraction", "--num-shards", "--out", "--seed",
                 "--workers", "--num-nodes", "--node-rank", "--node-wait", "--array-throttle", "--stage-cpus",
                 "--stage-mem", "--stage-time"):
        assert flag in result.stdout


def test_manifest_lists_only_complete_files(inputs, tmp_path) -> None:
    out = tmp_path / "out"
    assert build(out, "--text", str(inputs["text"]), "--vocab", str(inputs["vocab"]), "--seq-lens", "64",
                 "--num-shards", "2", "--workers", "1") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {s["file"] for s in manifest["seq_lens"]["64"]["train"]["shards"]}
    on_disk = {str(p.relative_to(out)) for p in (out / "seq64").glob("*")}
    assert listed == on_disk == {"seq64/train-00000.arrow", "seq64/train-00001.arrow"}


def test_skip_bad_files_skips_non_utf8_books_with_a_warning(inputs, tmp_path, capsys) -> None:
    books = tmp_path / "books"
    write_books(books, books=2)
    (books / "latin1.txt").write_bytes("Bruneti\u00e8re wrote a long book.\n".encode("latin-1") * 20)
    (books / "README").write_text("not a book: no .txt suffix\n" * 20, encoding="utf-8")
    flags = ["--books", str(books), "--vocab", str(inputs["vocab"]), "--seq-lens", "64", "--num-shards", "1",
             "--workers", "1"]
    assert build(tmp_path / "strict", *flags) == 2
    assert build(tmp_path / "lenient", *flags, "--skip-bad-files") == 0
    assert "warning: skipped (--skip-bad-files): --books" in capsys.readouterr().err
    assert check_output(tmp_path / "lenient").data["totals"]["input_documents"] == 2
