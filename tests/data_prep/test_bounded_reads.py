"""Reading input costs bounded memory whatever the input: one huge JSON line, a .bz2 bomb, a dump of many pages,
a page larger than MediaWiki allows. And a manifest cannot name a file outside its folder.

Memory is Python's own allocations (tracemalloc), which the readers' buffers and strings all are.
"""

from __future__ import annotations

import bz2
import gc
import json
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from data_prep.config import DocumentLimits
from data_prep.shard_format.shards import Manifest, ShardFormatError
from data_prep.source_files import DocumentTooLarge
from data_prep.sources import SKIPPED, read_book_file, read_jsonl_file, read_sentence_lines, read_wiki_dump

MIB = 1 << 20
SMALL = DocumentLimits(max_document_bytes=MIB, max_wikitext_chars=MIB)


def peak_allocated(work) -> tuple[object, int]:
    """What `work()` returns and the most bytes it had allocated at once."""
    tracemalloc.start()
    try:
        result = work()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def write_jsonl_with_long_line(folder: Path, line_bytes: int) -> Path:
    folder.mkdir()
    path = folder / "web.jsonl"
    with open(path, "wb") as handle:
        handle.write(json.dumps({"text": "First document.", "id": "a"}).encode() + b"\n")
        handle.write(b'{"text": "')
        block = b"x" * MIB
        for _ in range(line_bytes // MIB):
            handle.write(block)
        handle.write(b'", "id": "huge"}\n')
        handle.write(json.dumps({"text": "Last document.", "id": "b"}).encode() + b"\n")
    return path


def test_a_100_mb_json_line_is_passed_over_in_bounded_memory(tmp_path, capsys) -> None:
    """One JSON line of 100 MB used to be held, decoded and parsed whole (5.5x its size at the peak); over the cap
    it is now read 1 MiB at a time, skipped and counted (a SKIPPED placeholder), or named with its line number."""
    path = write_jsonl_with_long_line(tmp_path / "jsonl", 100 * MIB)
    docs, peak = peak_allocated(lambda: list(read_jsonl_file(path, path.parent, True, limits=SMALL)))
    assert [d.title for d in docs] == ["a", "web.jsonl#2", "b"]
    assert docs[1].layout == SKIPPED and docs[1].text == ""
    assert peak < 8 * MIB, f"peak {peak / MIB:.1f} MiB while reading a 100 MiB line"
    assert "line 2: 104,857,627 bytes, over the 1,048,576" in capsys.readouterr().err
    with pytest.raises(DocumentTooLarge, match=r"--jsonl .*web.jsonl: line 2: .* over the 1,048,576"):
        list(read_jsonl_file(path, path.parent, False, limits=SMALL))


def test_an_over_long_text_document_is_named_or_skipped(tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"A first sentence.\n\n" + b"y" * (2 * MIB) + b"\nand more.\n\nLast one here.\n")
    docs = list(read_sentence_lines(path, 0, None, True, SMALL))
    assert [(d.title, d.layout) for d in docs] == [("corpus.txt#1", "lines"), ("corpus.txt#2", SKIPPED),
                                                   ("corpus.txt#3", "lines")]
    with pytest.raises(DocumentTooLarge, match=r"--text .*corpus.txt: line 3: document over 1,048,576 bytes"):
        list(read_sentence_lines(path, 0, None, False, SMALL))


def test_a_bz2_bomb_is_decompressed_only_up_to_the_cap(tmp_path) -> None:
    """256 streams of 1 MiB of one byte each: 256 MiB from a file of a few KiB, as a book. Only the cap is
    decompressed (the old reader decompressed it all into one string)."""
    books = tmp_path / "books"
    books.mkdir()
    stream = bz2.compress(b"a" * MIB)
    (books / "bomb.txt.bz2").write_bytes(stream * 256)
    docs, peak = peak_allocated(lambda: list(read_book_file(books / "bomb.txt.bz2", books, True, SMALL)))
    assert [d.layout for d in docs] == [SKIPPED]
    assert peak < 8 * MIB, f"peak {peak / MIB:.1f} MiB"
    with pytest.raises(DocumentTooLarge, match=r"--books .*bomb.txt.bz2: over 1,048,576 bytes decompressed"):
        list(read_book_file(books / "bomb.txt.bz2", books, False, SMALL))


def pages_xml(count: int, big_page_chars: int = 0) -> Iterator[bytes]:
    """A dump of `count` small pages, after one of `big_page_chars` if given (in 1 MiB pieces)."""
    yield b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">\n<siteinfo><sitename>W</sitename></siteinfo>\n'
    if big_page_chars:
        yield b"<page><title>Huge</title><ns>0</ns><revision><text>"
        for _ in range(big_page_chars // MIB):
            yield b"z" * MIB
        yield b"</text></revision></page>\n"
    for index in range(count):
        yield (f"<page><title>P{index}</title><ns>0</ns><id>{index}</id><revision><id>{index}</id>"
               f"<text>Page {index} says something.</text></revision></page>\n").encode()
    yield b"</mediawiki>\n"


def test_the_dump_reader_memory_stays_flat_over_many_pages(tmp_path) -> None:
    """Each page is freed: the Python objects alive after 20,000 pages are those alive after 2,000 (iterparse kept
    every cleared page on the root: an element, 88 bytes, a page; 2 GB over English Wikipedia). Counted as
    allocated blocks (`sys.getallocatedblocks`, no tracing, so the reader runs at its own speed)."""
    dump = tmp_path / "many.xml"
    with open(dump, "wb") as handle:
        handle.writelines(pages_xml(20_000))
    sampled, last = {}, ""
    for number, doc in enumerate(read_wiki_dump(dump), start=1):
        if number in (2_000, 20_000):
            gc.collect()
            sampled[number] = sys.getallocatedblocks()
        last = doc.title
    assert last == "P19999"
    growth = sampled[20_000] - sampled[2_000]
    assert growth < 1_000, f"{growth / 18_000:.2f} objects kept per page"


def test_a_page_over_the_cap_is_never_held_and_is_named_or_skipped(tmp_path, capsys) -> None:
    dump = tmp_path / "big.xml.bz2"
    streams: dict[bytes, bytes] = {}  # bz2 streams one after another (multistream): each piece compressed once
    with open(dump, "wb") as handle:
        for block in pages_xml(3, big_page_chars=16 * MIB):
            if block not in streams:
                streams[block] = bz2.compress(block)
            handle.write(streams[block])
    docs, peak = peak_allocated(lambda: list(read_wiki_dump(dump, True, SMALL)))
    assert [(d.title, d.layout) for d in docs] == [("Huge", SKIPPED), ("P0", "wikitext"), ("P1", "wikitext"),
                                                   ("P2", "wikitext")]
    assert peak < 8 * MIB, f"peak {peak / MIB:.1f} MiB for a 16 MiB page"
    assert "page 'Huge': 16,777,216 characters of wikitext, over the 1,048,576" in capsys.readouterr().err
    with pytest.raises(DocumentTooLarge, match=r"--wiki-dump .*big.xml.bz2: page 'Huge'"):
        list(read_wiki_dump(dump, False, SMALL))


def write_manifest(root: Path, shard_file: str, vocab_file: str = "vocab.txt") -> None:
    root.mkdir(exist_ok=True)
    shard = {"file": shard_file, "num_instances": 1, "sha256": "0" * 64}
    (root / "manifest.json").write_text(json.dumps({
        "format": "bert-ds-shards", "format_version": 1, "vocab": {"file": vocab_file, "size": 5, "sha256": ""},
        "masking": {"mode": "dynamic"}, "seq_lens": {"64": {"train": {"shards": [shard]}}},
    }), encoding="utf-8")


@pytest.mark.parametrize(("shard", "vocab"), [("../x.arrow", "vocab.txt"), ("/etc/passwd", "vocab.txt"),
                                              ("seq64/../../x.arrow", "vocab.txt"), ("seq64/a.arrow", "../v.txt")])
def test_a_manifest_entry_outside_its_folder_is_refused(tmp_path, shard: str, vocab: str) -> None:
    write_manifest(tmp_path / "shards", shard, vocab)
    bad = shard if vocab == "vocab.txt" else vocab
    with pytest.raises(ShardFormatError, match=rf"file entry '{bad}' is not a path inside"):
        Manifest.load(tmp_path / "shards")
    write_manifest(tmp_path / "shards", "seq64/train-00000.arrow")  # what a build writes loads
    assert Manifest.load(tmp_path / "shards").shards(64)[0].file == "seq64/train-00000.arrow"
