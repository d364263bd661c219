"""Compressed and columnar inputs (docs/data_prep.md#compressed-and-columnar-inputs): gzip and zstd files and a
parquet folder give the shards their plain equivalents give; a folder source never passes over a file unnamed;
decompression is bounded by the cap on one document.

One small corpus serves the builds: the `--text` files of tests/data_prep/test_input_shards.py, each document also
written as a JSON line (a paragraph per line) and a parquet row.
"""

from __future__ import annotations

import bz2
import gzip
import json
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.__main__ import build_parser, config_from_args, main
from data_prep.config import DocumentLimits
from data_prep.input_plan import make_plan, read_shard
from data_prep.parquet_source import read_parquet_file, row_group_starts
from data_prep.source_files import DocumentTooLarge, SourceError, read_text
from data_prep.sources import SKIPPED, read_jsonl_file
from tests.data_prep.test_input_shards import write_corpus
from tests.support.data_prep_fixtures import tree_digest

MIB = 1 << 20
BUILD = ["--seq-lens", "32", "--num-shards", "2", "--val-fraction", "0.1", "--docs-per-chunk", "8", "--seed", "5",
         "--workers", "1"]


def corpus(root: Path) -> tuple[list[Path], Path, list[dict]]:
    """The three --text files, their vocab, and their documents as rows (a sentence per line of `text`)."""
    flags = write_corpus(root)
    texts = [Path(flags[i + 1]) for i, flag in enumerate(flags) if flag == "--text"]
    vocab = Path(flags[flags.index("--vocab") + 1])
    rows = []
    for path in texts:
        for k, block in enumerate(path.read_text(encoding="utf-8").split("\n\n")):
            if block.strip():
                rows.append({"title": f"{path.stem}-{k}", "text": block.strip()})
    return texts, vocab, rows


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def built(out: Path, *inputs: str, vocab: Path, extra: tuple[str, ...] = ()) -> dict[str, object]:
    """Build, and return what identity compares: every shard's sha256 and the manifest but its `config` (which
    records the input paths, so a compressed copy's differs there only)."""
    assert main(["build", *inputs, "--vocab", str(vocab), "--out", str(out), *BUILD, *extra]) == 0
    digests = {name: sha for name, sha in tree_digest(out).items() if name != "manifest.json"}
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    manifest.pop("config")
    return {"shards": digests, "manifest": manifest}


def test_jsonl_gz_beside_jsonl_and_txt_gz_and_zst_build_the_plain_shards(tmp_path: Path) -> None:
    """A folder of `a.jsonl.gz` + `b.jsonl` (before: `b.jsonl` alone was built, every document of the .gz lost
    without a word), C4's `*.json.gz` naming, and `--text x.txt.gz` / `.zst`: the shards of the plain files."""
    texts, vocab, rows = corpus(tmp_path / "in")
    half = len(rows) // 2
    plain, mixed, c4 = tmp_path / "plain", tmp_path / "mixed", tmp_path / "c4"
    for folder in (plain, mixed, c4):
        folder.mkdir()
    (plain / "a.jsonl").write_bytes(jsonl_bytes(rows[:half]))
    (plain / "b.jsonl").write_bytes(jsonl_bytes(rows[half:]))
    (mixed / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(rows[:half])))
    (mixed / "b.jsonl").write_bytes(jsonl_bytes(rows[half:]))
    (c4 / "c4-train.00000-of-00002.json.gz").write_bytes(gzip.compress(jsonl_bytes(rows[:half])))
    (c4 / "c4-train.00001-of-00002.json.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(rows[half:])))
    reference = built(tmp_path / "o_plain", "--jsonl", str(plain), vocab=vocab)
    assert reference["manifest"]["totals"]["input_documents"] == len(rows)  # type: ignore[index]
    assert built(tmp_path / "o_mixed", "--jsonl", str(mixed), vocab=vocab) == reference
    assert built(tmp_path / "o_c4", "--jsonl", str(c4), vocab=vocab) == reference

    joined = tmp_path / "joined.txt"
    joined.write_bytes(b"\n\n".join(path.read_bytes() for path in texts))
    (tmp_path / "joined.txt.gz").write_bytes(gzip.compress(joined.read_bytes()))
    (tmp_path / "joined.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(joined.read_bytes()))
    text_reference = built(tmp_path / "o_txt", "--text", str(joined), vocab=vocab)
    assert built(tmp_path / "o_gz", "--text", str(tmp_path / "joined.txt.gz"), vocab=vocab) == text_reference
    assert built(tmp_path / "o_zst", "--text", str(tmp_path / "joined.txt.zst"), vocab=vocab) == text_reference


def write_parquet(path: Path, rows: list[dict], rows_per_group: int) -> None:
    table = pa.table({"id": [row["title"] for row in rows], "body": [row["text"] for row in rows]})
    pq.write_table(table, path, row_group_size=rows_per_group)


def test_a_parquet_folder_builds_the_jsonl_shards_and_is_cut_at_row_groups(tmp_path: Path) -> None:
    """The rows as parquet (the text in a column named by --parquet-text-field) build the JSON lines' shards; with
    a small input shard the file is cut into ranges of whole row groups that hold every row once, in order."""
    _, vocab, rows = corpus(tmp_path / "in")
    jsonl, parquet = tmp_path / "jsonl", tmp_path / "parquet"
    jsonl.mkdir()
    parquet.mkdir()
    (jsonl / "rows.jsonl").write_bytes(jsonl_bytes(rows))
    write_parquet(parquet / "rows.parquet", rows, rows_per_group=10)
    reference = built(tmp_path / "o_jsonl", "--jsonl", str(jsonl), vocab=vocab)
    assert built(tmp_path / "o_parquet", "--parquet", str(parquet), vocab=vocab,
                 extra=("--parquet-text-field", "body")) == reference

    path = parquet / "rows.parquet"
    groups = row_group_starts(path)
    assert len(groups) == -(-len(rows) // 10)
    shard_mb = sum(size for _, size in groups) / 4 / MIB  # about a quarter of the row groups per unit
    cfg = config_from_args(build_parser().parse_args(
        ["build", "--parquet", str(parquet), "--parquet-text-field", "body", "--vocab", str(vocab),
         "--out", str(tmp_path / "o"), "--input-shard-mb", str(shard_mb)]))
    units = [unit for shard in make_plan(cfg).shards for unit in shard]
    assert 3 <= len(units) <= 6 and units[0].start == 0 and units[-1].end is None
    assert [u.start for u in units[1:]] == [u.end for u in units[:-1]]
    assert all(u.start in {offset for offset, _ in groups} for u in units[1:])  # cut at row-group starts
    ranged = [doc.text for shard in make_plan(cfg).shards for doc in read_shard(cfg, shard)]
    whole = [doc.text for doc in read_parquet_file(path, parquet, "body")]
    assert ranged == whole == [row["text"] for row in rows]


def test_a_missing_column_or_broken_parquet_file_is_named_before_work_or_skipped(tmp_path: Path, capsys) -> None:
    _, vocab, rows = corpus(tmp_path / "in")
    (tmp_path / "p").mkdir()
    write_parquet(tmp_path / "p" / "rows.parquet", rows, rows_per_group=50)
    assert main(["build", "--parquet", str(tmp_path / "p"), "--vocab", str(vocab), "--out", str(tmp_path / "o"),
                 *BUILD]) == 2
    assert "rows.parquet: no column 'text' (columns: id, body)" in capsys.readouterr().err
    (tmp_path / "p" / "broken.parquet").write_bytes(b"PAR1 not really")
    args = ["build", "--parquet", str(tmp_path / "p"), "--parquet-text-field", "body", "--vocab", str(vocab), *BUILD]
    assert main([*args, "--out", str(tmp_path / "o2")]) == 2
    assert "broken.parquet: not a readable parquet file" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "o3"), "--skip-bad-files"]) == 0
    assert "skipped (--skip-bad-files): --parquet" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "o3" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["totals"]["input_documents"] == len(rows)


def test_a_file_of_no_known_kind_or_unreadable_is_refused_by_name_or_skipped_and_counted(tmp_path: Path,
                                                                                          capsys) -> None:
    """A folder never passes over a file without a word: `notes.md` (no suffix --jsonl reads) and a corrupt
    `.jsonl.gz` stop the build naming them; under --skip-bad-files the build goes on and the warnings name them."""
    _, vocab, rows = corpus(tmp_path / "in")
    folder = tmp_path / "j"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl_bytes(rows))
    (folder / "notes.md").write_text("not a corpus\n", encoding="utf-8")
    (folder / "part-1.jsonl.parquet").write_bytes(b"PAR1")
    args = ["build", "--jsonl", str(folder), "--vocab", str(vocab), *BUILD]
    assert main([*args, "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert "2 file(s) of no known kind" in err and "notes.md, part-1.jsonl.parquet" in err
    (folder / "notes.md").unlink()
    (folder / "part-1.jsonl.parquet").unlink()
    (folder / "z.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(rows))[:40] + b"\x00" * 64)  # corrupt
    assert main([*args, "--out", str(tmp_path / "o2")]) == 2
    assert "z.jsonl.gz: corrupt or unreadable" in capsys.readouterr().err
    (folder / "notes.md").write_text("not a corpus\n", encoding="utf-8")
    assert main([*args, "--out", str(tmp_path / "o3"), "--skip-bad-files"]) == 0
    err = capsys.readouterr().err
    assert "skipped (--skip-bad-files): --jsonl" in err and "1 file(s) of no known kind" in err and "notes.md" in err
    assert "z.jsonl.gz: corrupt or unreadable" in err
    manifest = json.loads((tmp_path / "o3" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["totals"]["input_documents"] == len(rows)  # a.jsonl's, every one


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_a_compression_bomb_is_decompressed_only_up_to_the_cap(tmp_path: Path, kind: str) -> None:
    """64 MiB of one byte in a file of about 64 KiB (gzip) or a few KiB (zstd), read whole as a book and as one
    JSON line: only the cap (1 MiB here) is decompressed, and the allocations stay under a few MiB."""
    small = DocumentLimits(max_document_bytes=MIB, max_wikitext_chars=MIB)
    data = b'{"text": "' + b"a" * (64 * MIB) + b'"}\n' + json.dumps({"text": "After.", "id": "b"}).encode() + b"\n"
    packed = gzip.compress(data, compresslevel=1) if kind == "gz" else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"bomb.jsonl.{kind}"
    path.write_bytes(packed)
    assert path.stat().st_size < MIB
    tracemalloc.start()
    try:
        with pytest.raises(DocumentTooLarge, match=r"over 1,048,576 bytes decompressed"):
            read_text(path, small.max_document_bytes)
        docs = list(read_jsonl_file(path, tmp_path, True, limits=small))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [d.layout for d in docs][0] == SKIPPED and docs[1].text == "After."
    assert peak < 8 * MIB, f"peak {peak / MIB:.1f} MiB"


@pytest.mark.parametrize("kind", ["gz", "zst", "bz2"])
def test_a_file_cut_off_mid_stream_is_named_not_read_short(tmp_path: Path, kind: str) -> None:
    """A compressed file cut off (a copy or download that stopped) stops the build naming it: python-zstandard's
    reader ends a cut-off frame without a word, which lost the rest of the file's documents."""
    data = jsonl_bytes([{"text": f"Document {k} says a few words."} for k in range(20_000)])
    packed = {"gz": gzip.compress, "bz2": bz2.compress, "zst": zstandard.ZstdCompressor().compress}[kind](data)
    path = tmp_path / f"cut.jsonl.{kind}"
    path.write_bytes(packed[: len(packed) * 2 // 3])
    with pytest.raises(SourceError, match=rf"^--jsonl .*cut.jsonl.{kind}: corrupt or unreadable"):
        list(read_jsonl_file(path, tmp_path))


def test_a_parquet_row_over_the_cap_is_left_out_in_its_place_or_named(tmp_path: Path) -> None:
    small = DocumentLimits(max_document_bytes=MIB, max_wikitext_chars=MIB)
    rows = [{"title": "a", "text": "First."}, {"title": "huge", "text": "x" * (2 * MIB)}, {"title": "c", "text": "Last."}]
    write_parquet(tmp_path / "rows.parquet", rows, rows_per_group=2)
    docs = list(read_parquet_file(tmp_path / "rows.parquet", tmp_path, "body", True, limits=small))
    assert [(d.title, d.layout, d.text) for d in docs] == [("a", "paragraph_lines", "First."), ("huge", SKIPPED, ""),
                                                          ("c", "paragraph_lines", "Last.")]
    with pytest.raises(DocumentTooLarge, match=r"--parquet .*rows.parquet: row 1: 2,097,152 bytes, over the 1,048,576"):
        list(read_parquet_file(tmp_path / "rows.parquet", tmp_path, "body", False, limits=small))
