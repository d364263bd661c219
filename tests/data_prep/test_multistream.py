"""A multistream `.bz2` dump cut at its stream starts (data_prep/bz2_streams.py): the ranges hold every page once,
in order; a dump whose streams do not start at pages (pbzip2's) is never cut; a cut dump gives the same bytes on
any number of nodes, and an uncut one the bytes of the same pages in one stream.

The dump is made here as Wikimedia makes theirs: the header and <siteinfo> in one stream, pages in groups of
five each compressed on its own, `</mediawiki>` in the last stream.
"""

from __future__ import annotations

import bz2
import json
import random
from pathlib import Path

from data_prep.__main__ import build_parser, config_from_args, main
from data_prep.bz2_streams import stream_cuts
from data_prep.input_plan import make_plan, read_shard
from data_prep.sources import read_wiki_dump
from tests.support.data_prep_fixtures import tree_digest

HEAD = (b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" xml:lang="en">\n'
        b"<siteinfo><sitename>Wikipedia</sitename></siteinfo>\n")
TAIL = b"</mediawiki>\n"
WORDS = [f"w{k}" for k in range(40)]
BUILD = ["--seq-lens", "32", "--num-shards", "2", "--val-fraction", "0.1", "--docs-per-chunk", "4", "--seed", "5",
         "--workers", "1", "--keep-work"]


def pages(count: int) -> list[bytes]:
    rng = random.Random(7)
    out = []
    for index in range(count):
        sentences = ". ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) for _ in range(8))
        out.append(f"<page><title>Page {index}</title><ns>0</ns><id>{index + 1}</id><revision><id>{index}</id>"
                   f"<text>{sentences.capitalize()}.\n\nA second paragraph of page {index}.</text></revision></page>\n"
                   .encode())
    return out


def multistream(path: Path, count: int = 60, per_stream: int = 5) -> bytes:
    """The dump as Wikimedia writes it; returns its XML."""
    body = pages(count)
    groups = [b"".join(body[k : k + per_stream]) for k in range(0, count, per_stream)]
    path.write_bytes(b"".join(bz2.compress(part) for part in [HEAD, *groups, TAIL]))
    return HEAD + b"".join(groups) + TAIL


def plan_of(dump: Path, tmp_path: Path, shard_mb: float):  # type: ignore[no-untyped-def]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]) + "\n", encoding="utf-8")
    cfg = config_from_args(build_parser().parse_args(
        ["build", "--wiki-dump", str(dump), "--vocab", str(vocab), "--out", str(tmp_path / "o"),
         "--input-shard-mb", str(shard_mb)]))
    return cfg, make_plan(cfg)


def test_a_multistream_dump_is_cut_at_page_streams_holding_every_page_once(tmp_path: Path) -> None:
    dump = tmp_path / "enwiki-multistream.xml.bz2"
    multistream(dump)
    size = dump.stat().st_size
    cfg, plan = plan_of(dump, tmp_path, size / 5 / (1 << 20))
    units = [unit for shard in plan.shards for unit in shard]
    assert 4 <= len(units) <= 6 and units[0].start == 0 and units[-1].end is None
    assert [u.start for u in units[1:]] == [u.end for u in units[:-1]]
    data = dump.read_bytes()
    for unit in units[1:]:  # each cut a stream start whose text is a page
        assert data[unit.start : unit.start + 4] == b"BZh9"
        assert bz2.BZ2Decompressor().decompress(data[unit.start :]).startswith(b"<page>")
    whole = [(d.title, d.text) for d in read_wiki_dump(dump)]
    assert len(whole) == 60
    assert [(d.title, d.text) for shard in plan.shards for d in read_shard(cfg, shard)] == whole


def test_streams_that_do_not_start_at_pages_are_never_cut(tmp_path: Path) -> None:
    """pbzip2 compresses fixed-size pieces, each a stream starting anywhere in the XML: no cut is safe there."""
    xml = multistream(tmp_path / "ref.xml.bz2")
    dump = tmp_path / "pbzip2.xml.bz2"
    dump.write_bytes(b"".join(bz2.compress(xml[k : k + 777]) for k in range(0, len(xml), 777)))
    assert stream_cuts(dump, dump.stat().st_size, 6) == []
    cfg, plan = plan_of(dump, tmp_path, dump.stat().st_size / 6 / (1 << 20))
    assert [unit.whole for shard in plan.shards for unit in shard] == [True]
    assert [d.title for d in read_wiki_dump(dump)] == [f"Page {k}" for k in range(60)]


def test_a_cut_dump_gives_the_same_bytes_on_any_number_of_nodes(tmp_path: Path) -> None:
    """Cut in about three: one worker, and node 0 of 2 then the merge, give the same shards; uncut (the default
    input shard), the multistream dump gives the bytes of its pages as one stream (what every build did)."""
    dump = tmp_path / "enwiki-multistream.xml.bz2"
    xml = multistream(dump)
    single = tmp_path / "single.xml.bz2"
    single.write_bytes(bz2.compress(xml))
    cfg, plan = plan_of(dump, tmp_path, dump.stat().st_size / 3 / (1 << 20))
    assert 3 <= plan.num_shards <= 4
    vocab = str(cfg.vocab)
    flags = ["--wiki-dump", str(dump), "--vocab", vocab, *BUILD]
    cut = [*flags, "--input-shard-mb", str(dump.stat().st_size / 3 / (1 << 20))]
    one, nodes = tmp_path / "one", tmp_path / "nodes"
    assert main(["build", *cut, "--out", str(one)]) == 0
    assert main(["build", *cut, "--out", str(nodes), "--num-nodes", "2", "--node-rank", "0",
                 "--node-wait", "0"]) == 0
    assert main(["merge", "--out", str(nodes), "--workers", "1", "--keep-work"]) == 0
    assert tree_digest(nodes) == tree_digest(one)
    markers = [json.loads((one / "work" / "done" / f"clean-{s:05d}.json").read_text()) for s in range(plan.num_shards)]
    assert sum(m["input_documents"] for m in markers) == 60

    whole, reference = tmp_path / "whole", tmp_path / "reference"
    assert main(["build", *flags, "--out", str(whole)]) == 0
    assert main(["build", "--wiki-dump", str(single), "--vocab", vocab, *BUILD, "--out", str(reference)]) == 0
    shards = {name: sha for name, sha in tree_digest(whole).items() if name != "manifest.json"}
    assert shards == {name: sha for name, sha in tree_digest(reference).items() if name != "manifest.json"}
