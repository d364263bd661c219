"""One large plain input file cut into input shards at document starts (data_prep/byte_ranges.py): the ranges
hold every document once and whole, whatever the cut offsets, and nodes sharing one file give the same bytes."""

from __future__ import annotations

import bz2
import json
import random
from pathlib import Path

import pytest

from data_prep.__main__ import build_parser, config_from_args, main
from data_prep.byte_ranges import BLANK_LINE, LINE, cut_points
from data_prep.input_plan import make_plan, read_shard
from data_prep.sources import read_jsonl_file, read_sentence_lines
from tests.data_prep.test_input_shards import write_corpus
from tests.support.data_prep_fixtures import tree_digest


def text_file(path: Path, documents: int, seed: int = 3) -> Path:
    """Documents of 1-6 lines, separated by one to three blank (or whitespace-only) lines."""
    rng = random.Random(seed)
    parts = []
    for d in range(documents):
        parts.append("\n".join(f"doc {d} line {k} " + "word " * rng.randint(1, 20) for k in range(rng.randint(1, 6))))
        parts.append("\n" + rng.choice(["\n", "  \n", "\n\n"]))
    path.write_text("".join(parts), encoding="utf-8")
    return path


@pytest.mark.parametrize("pieces", [2, 3, 7, 40])
def test_text_ranges_hold_every_document_once(tmp_path: Path, pieces: int) -> None:
    path = text_file(tmp_path / "corpus.txt", 60)
    whole = [doc.text for doc in read_sentence_lines(path)]
    cuts = cut_points(path, path.stat().st_size, pieces, BLANK_LINE)
    assert cuts == sorted(set(cuts)) and len(cuts) <= pieces - 1 and len(cuts) >= min(pieces - 1, 10)
    bounds = [0, *cuts, None]
    ranged = [doc.text for k in range(len(bounds) - 1) for doc in read_sentence_lines(path, bounds[k], bounds[k + 1])]
    assert ranged == whole
    data = path.read_bytes()
    assert all(data[c - 1 : c] == b"\n" and data[c : c + 4] == b"doc " for c in cuts)  # each cut a document start


@pytest.mark.parametrize("pieces", [2, 5, 30])
def test_jsonl_ranges_hold_every_line_once(tmp_path: Path, pieces: int) -> None:
    folder = tmp_path / "j"
    folder.mkdir()
    rows = [{"title": f"t{i}", "text": "x " * (i % 17 + 1)} for i in range(50)]
    path = folder / "a.jsonl"
    path.write_text("".join(json.dumps(r) + ("\n\n" if i % 9 == 0 else "\n") for i, r in enumerate(rows)), encoding="utf-8")
    whole = [(d.title, d.text) for d in read_jsonl_file(path, folder)]
    bounds = [0, *cut_points(path, path.stat().st_size, pieces, LINE), None]
    ranged = [(d.title, d.text) for k in range(len(bounds) - 1)
              for d in read_jsonl_file(path, folder, False, bounds[k], bounds[k + 1])]
    assert ranged == whole and len(bounds) - 1 == pieces


def test_plan_cuts_large_plain_files_only(tmp_path: Path) -> None:
    big = text_file(tmp_path / "big.txt", 200)
    compressed = tmp_path / "big2.txt.bz2"
    compressed.write_bytes(bz2.compress(big.read_bytes() * 3))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n", encoding="utf-8")
    size_mb = big.stat().st_size / 4 / (1 << 20)  # a quarter of the plain file
    cfg = config_from_args(build_parser().parse_args(
        ["build", "--text", str(big), "--text", str(compressed), "--vocab", str(vocab), "--out", str(tmp_path / "o"),
         "--input-shard-mb", str(size_mb)]))
    plan = make_plan(cfg)
    units = [unit for shard in plan.shards for unit in shard]
    plain = [u for u in units if u.file == str(big)]
    assert len(plain) == 4 and all(len(shard) == 1 for shard in plan.shards)
    assert [u.start for u in plain[1:]] == [u.end for u in plain[:-1]] and plain[-1].end is None
    assert [u.whole for u in units if u.file == str(compressed)] == [True]  # bz2: no random access, one unit
    documents = [d.text for shard in plan.shards[:4] for d in read_shard(cfg, shard)]
    assert documents == [d.text for d in read_sentence_lines(big)]


def test_nodes_sharing_one_file_give_the_same_bytes(tmp_path: Path) -> None:
    """The three-group corpus as one --text file, cut into three ranges: node 0 of 2 cleans ranges 0 and 2,
    the merge range 1 (node 1 never ran), and the shards equal a one-worker build's."""
    flags = write_corpus(tmp_path / "inputs")
    joined = tmp_path / "inputs" / "joined.txt"
    files = [flags[i + 1] for i, f in enumerate(flags) if f == "--text"]
    joined.write_text("\n\n".join(Path(f).read_text(encoding="utf-8") for f in files), encoding="utf-8")
    rest = [f for i, f in enumerate(flags) if f != "--text" and (i == 0 or flags[i - 1] != "--text")]
    at = rest.index("--input-shard-mb") + 1
    rest[at] = str(joined.stat().st_size / 3 / (1 << 20))
    rest += ["--text", str(joined)]
    one, nodes = tmp_path / "one", tmp_path / "nodes"
    assert main(["build", *rest, "--out", str(one), "--workers", "1"]) == 0
    assert main(["build", *rest, "--out", str(nodes), "--workers", "1", "--num-nodes", "2", "--node-rank", "0",
                 "--node-wait", "0"]) == 0
    assert main(["merge", "--out", str(nodes), "--workers", "1", "--keep-work"]) == 0
    assert tree_digest(nodes) == tree_digest(one)
    markers = [json.loads((nodes / "work" / "done" / f"clean-{s:05d}.json").read_text()) for s in range(3)]
    ranges = [m["input_files"] for m in markers]
    assert all(len(r) == 1 and r[0].startswith(f"{joined}@") for r in ranges)
    assert sum(m["input_documents"] for m in markers) == 120
