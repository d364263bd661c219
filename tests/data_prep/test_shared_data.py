"""Integration: the real Wikipedia dumps and two real books from ../shared/data -> seq 128 and 512 shards."""

from __future__ import annotations

import re

import pyarrow.ipc as ipc
import pytest

from data_prep.__main__ import main
from data_prep.report import decode
from data_prep.shard_format.shards import ShardReader
from data_prep.shard_format.vocab import load_vocab
from tests.support.data_prep_fixtures import check_output

WIKI_DUMP = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
TABLE_DUMP = "wikipedia/enwiki-table-markup.xml.bz2"
BOOKS = ("austen-persuasion.txt", "chesterton-thursday.txt")
MARKUP = re.compile(r"\[\[|\]\]|\{\{|\}\}|<ref|</ref|''|==|\{\||\|-|\|\}|class=|wikitable|Category:|File:|thumb\|")


@pytest.mark.shared_data
def test_real_dump_and_books_to_128_and_512_shards(shared_data, tmp_path) -> None:
    books = tmp_path / "books"
    books.mkdir()
    for name in BOOKS:  # links, not copies: the data stays in ../shared/data
        (books / name).symlink_to(shared_data / "books" / "nltk_gutenberg" / name)
    out = tmp_path / "out"
    code = main([
        "build", "--wiki-dump", str(shared_data / WIKI_DUMP), "--wiki-dump", str(shared_data / TABLE_DUMP),
        "--books", str(books), "--vocab", str(shared_data / "vocab" / "bert-base-uncased-vocab.txt"),
        "--seq-lens", "128,512", "--num-shards", "4", "--val-fraction", "0.02", "--workers", "2", "--keep-work",
        "--out", str(out), "--seed", "1",
    ])
    assert code == 0
    manifest = check_output(out, min_instances=1000)
    totals = manifest.data["totals"]
    # The big dump has 206 pages: 100 redirects, 1 outside the main namespace, 8 disambiguation
    # pages ({{disambiguation}}, {{geodis}}, "(disambiguation)" titles) -> 98 articles; plus
    # the 5 articles of the table dump and the 2 books.
    assert totals["input_documents"] == 98 + 5 + 2
    assert totals["documents"] == 105
    assert manifest.data["vocab"]["lowercase"] is True and manifest.vocab_size == 30522

    # No wiki markup survives cleaning (checked on the cased, cleaned text) ...
    cleaned = []
    for part in sorted((out / "work" / "text").glob("shard-*.arrow")):  # one file per input shard
        table = ipc.open_file(str(part)).read_all()
        cleaned += [s for doc in table.column("sentences").to_pylist() for s in doc]
    text = "\n".join(cleaned)
    assert not MARKUP.search(text), MARKUP.search(text)
    assert "Anarchism is a political philosophy" in text
    # ... nor in decoded instances.
    vocab = load_vocab(manifest.vocab_path)
    reader = ShardReader(manifest, 512, "train")
    decoded = " ".join(decode(vocab.tokens, reader[i]["input_ids"].tolist()) for i in range(0, len(reader), 7))
    assert not re.search(r"\[\[|\{\{|\}\}|\]\]|< ref|ref >", decoded)
    assert manifest.data["seq_lens"]["512"]["train"]["num_instances"] > 500


@pytest.mark.shared_data
def test_real_wikiextractor_output_is_read(shared_data) -> None:
    from data_prep.sources import read_wikiextractor, to_sentences

    docs = list(read_wikiextractor(shared_data / "wikipedia" / "wikiextractor_sample"))
    assert len(docs) == 37 and docs[0].title == "Anarchism"
    sentences = to_sentences(docs[0])
    assert sentences[0].startswith("Anarchism is an anti-authoritarian political and social philosophy")
    assert all(s != "Anarchism" for s in sentences[:3])  # the repeated title line is not text
