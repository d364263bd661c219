"""Fast unit tests of data_prep's pure parts: cleaning, sentences, sources, instances, masking."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from data_prep.clean import wikitext_to_paragraphs
from data_prep.instances import instances_from_document, truncate_pair
from data_prep.sentences import split_sentences
from data_prep.shard_format.masking import SpecialIds, mask_instance
from data_prep.shard_format.vocab import VocabError, load_vocab, train_vocab
from data_prep.sources import (
    SourceError,
    check_readable_file,
    read_books,
    read_sentence_lines,
    read_wiki_dump,
    read_wikiextractor,
    to_sentences,
)
from tests.support.data_prep_fixtures import write_books, write_sentence_file, write_vocab, write_wiki_dump
from tests.support.facts_corpus import write_facts_corpus

MARKUP = re.compile(r"\[\[|\]\]|\{\{|\}\}|<ref|</|''|==|\{\||\|\}|Category:|File:|thumb\|")
SPECIAL = SpecialIds(cls=2, sep=3, mask=4, pad=0, unk=1)
FACTS_VOCAB_SHA256 = "5ae8b618d98e224c8b0d0e2c18fbefa1b8e61af48560d8f9d579c56cf661698a"  # the facts corpus's trained vocab


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Mr. Smith left. He came back!", ["Mr. Smith left.", "He came back!"]),
        ('She said "Stop." Then she ran.', ['She said "Stop."', "Then she ran."]),
        ("J. R. R. Tolkien wrote e.g. books. It cost 3.5 dollars?", ["J. R. R. Tolkien wrote e.g. books.",
                                                                    "It cost 3.5 dollars?"]),
        ("no terminal punctuation here", ["no terminal punctuation here"]),
        ("", []),
    ],
)
def test_split_sentences(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


def test_wikitext_markup_is_removed_and_prose_kept() -> None:
    wikitext = (
        "{{Infobox person|name=X}}\n'''Ada''' was a [[mathematician|maths person]] in [[London]].<ref>{{cite"
        " book|title=T}}</ref> She wrote ''notes''.\n== Life ==\n{| class=\"wikitable\"\n| cell || cell\n|}\n"
        "[[File:Ada.jpg|thumb|Portrait caption]]\n* Listed item text.\n[[Category:People]]\n[[fr:Ada]]"
    )
    paragraphs = wikitext_to_paragraphs(wikitext)
    text = "\n".join(paragraphs)
    assert paragraphs[0] == "Ada was a maths person in London. She wrote notes."
    assert "Listed item text." in paragraphs
    for gone in ("Life", "cell", "Portrait caption", "People", "Infobox", "fr:Ada", "cite"):
        assert gone not in text
    assert not MARKUP.search(text)


def test_wiki_dump_drops_redirects_disambiguation_and_other_namespaces(tmp_path) -> None:
    for name in ("dump.xml", "dump.xml.bz2"):
        titles = write_wiki_dump(tmp_path / name, articles=4)
        docs = list(read_wiki_dump(tmp_path / name))
        assert [d.title for d in docs] == titles
        text = "\n".join(s for d in docs for s in to_sentences(d))
        assert not MARKUP.search(text), MARKUP.search(text)
        assert "footnote" not in text and "Population" not in text


def test_corrupt_bz2_and_non_utf8_are_named(tmp_path) -> None:
    bad_bz2 = tmp_path / "dump.xml.bz2"
    bad_bz2.write_bytes(b"BZh91AY&SY" + b"\x00garbage" * 50)
    with pytest.raises(SourceError, match=r"--wiki-dump .*dump.xml.bz2: corrupt"):
        check_readable_file(bad_bz2, "--wiki-dump")
    latin1 = tmp_path / "book.txt"
    latin1.write_bytes("Caf\u00e9 au lait.\n".encode("latin-1") + b"more text " * 10)
    with pytest.raises(SourceError, match=r"--text .*book.txt: not UTF-8 \(byte offset 3\)"):
        check_readable_file(latin1, "--text")
    with pytest.raises(SourceError, match="no such file"):
        check_readable_file(tmp_path / "missing.txt", "--text")


def test_books_gutenberg_stripped_and_wrapped_lines_joined(tmp_path) -> None:
    write_books(tmp_path / "books", books=2)
    docs = list(read_books(tmp_path / "books"))
    assert [d.title for d in docs] == ["book0", "book1"]
    sentences = to_sentences(docs[0])
    assert all("LICENSEWORD" not in s and "Gutenberg" not in s for s in sentences)
    # Every sentence is whole: capitalised start, period end, no line breaks inside.
    assert all(s[0].isupper() and s.endswith(".") and "\n" not in s for s in sentences)


def test_sentence_lines_and_wikiextractor(tmp_path) -> None:
    write_sentence_file(tmp_path / "corpus.txt", documents=5)
    docs = list(read_sentence_lines(tmp_path / "corpus.txt"))
    assert len(docs) == 5 and all(len(to_sentences(d)) >= 4 for d in docs)
    folder = tmp_path / "extracted" / "AA"
    folder.mkdir(parents=True)
    (folder / "wiki_00").write_text(
        '<doc id="1" url="u" title="Alpha">\nAlpha\n\nFirst para. Second sentence.\n</doc>\n'
        '<doc id="2" url="u" title="Beta">\nBeta\n\nOnly one.\n</doc>\n',
        encoding="utf-8",
    )
    docs = list(read_wikiextractor(tmp_path / "extracted"))
    assert [(d.title, to_sentences(d)) for d in docs] == [
        ("Alpha", ["First para.", "Second sentence."]),
        ("Beta", ["Only one."]),
    ]


def test_vocab_checks_special_tokens_and_case(tmp_path) -> None:
    write_vocab(tmp_path / "vocab.txt")
    vocab = load_vocab(tmp_path / "vocab.txt")
    assert vocab.lowercase and vocab.special_ids["[MASK]"] == 4
    (tmp_path / "cased.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nThe\nthe\n", encoding="utf-8")
    assert not load_vocab(tmp_path / "cased.txt").lowercase
    (tmp_path / "bad.txt").write_text("[PAD]\n[UNK]\n[CLS]\nhello\n", encoding="utf-8")
    with pytest.raises(VocabError, match=r"bad.txt: lacks the special token\(s\) \[SEP\] \[MASK\]"):
        load_vocab(tmp_path / "bad.txt")


def _documents(rng: random.Random, count: int) -> list[list[list[int]]]:
    return [[[rng.randrange(10, 500) for _ in range(rng.randint(3, 12))] for _ in range(rng.randint(1, 30))]
            for _ in range(count)]


@pytest.mark.parametrize("seq_len", [64, 128, 256])
def test_instance_invariants(seq_len: int) -> None:
    docs = _documents(random.Random(seq_len), 40)
    rng = random.Random(7)
    instances = []
    for index in range(len(docs)):
        instances += instances_from_document(
            index, docs.__getitem__, lambda r: r.randrange(len(docs)), seq_len, 0.1, SPECIAL, rng
        )
    assert len(instances) > 20
    for inst in instances:
        ids = inst.input_ids
        assert len(ids) <= seq_len
        assert ids[0] == SPECIAL.cls and ids[inst.a_len - 1] == SPECIAL.sep and ids[-1] == SPECIAL.sep
        assert 3 <= inst.a_len <= len(ids) - 2  # A and B are both non-empty
        assert ids.count(SPECIAL.sep) == 2 and ids.count(SPECIAL.cls) == 1
    # BERT's rule: 50% random, plus always random when only one sentence is left (a small excess).
    random_fraction = sum(i.is_random_next for i in instances) / len(instances)
    assert 0.4 < random_fraction < 0.65


def test_segments_follow_or_come_from_another_document() -> None:
    # Sentence ids are distinct and increasing, 60 per document, so provenance is checkable.
    docs = [[[d * 60 + s * 5 + t + 10 for t in range(5)] for s in range(12)] for d in range(30)]
    rng = random.Random(3)
    consecutive = 0
    for index in range(len(docs)):
        for inst in instances_from_document(index, docs.__getitem__, lambda r: r.randrange(30), 64, 0.0, SPECIAL, rng):
            a = inst.input_ids[1 : inst.a_len - 1]
            b = inst.input_ids[inst.a_len : -1]
            if inst.is_random_next:
                assert (b[0] - 10) // 60 != index  # B from another document
            else:
                assert b[0] == a[-1] + 1  # B continues A (12 x 5 tokens fit: no truncation)
                consecutive += 1
    assert consecutive >= 5


def test_truncate_pair_trims_longer_side() -> None:
    a, b = list(range(10)), list(range(3))
    truncate_pair(a, b, 8, random.Random(0))
    assert len(a) == 5 and b == [0, 1, 2]


def test_static_masking_80_10_10_and_limits() -> None:
    rng = random.Random(11)
    vocab_size = 1000
    stats = {"mask": 0, "same": 0, "other": 0}
    for _ in range(400):
        ids = [SPECIAL.cls, *[rng.randrange(10, vocab_size) for _ in range(60)], SPECIAL.sep,
               *[rng.randrange(10, vocab_size) for _ in range(60)], SPECIAL.sep]
        masked = mask_instance(ids, 0.15, 20, SPECIAL, vocab_size, rng)
        assert 1 <= len(masked.masked_positions) <= 20
        assert masked.masked_positions == sorted(masked.masked_positions)
        for pos, label in zip(masked.masked_positions, masked.masked_label_ids, strict=True):
            assert ids[pos] == label and ids[pos] not in (SPECIAL.cls, SPECIAL.sep)
            new = masked.input_ids[pos]
            stats["mask" if new == SPECIAL.mask else "same" if new == label else "other"] += 1
        untouched = set(range(len(ids))) - set(masked.masked_positions)
        assert all(masked.input_ids[p] == ids[p] for p in untouched)
    total = sum(stats.values())
    assert abs(stats["mask"] / total - 0.8) < 0.03
    assert abs(stats["same"] / total - 0.1) < 0.03
    assert abs(stats["other"] / total - 0.1) < 0.03


def test_whole_word_masking_masks_whole_words() -> None:
    continuation = np.zeros(100, dtype=bool)
    continuation[50:] = True  # ids >= 50 are '##' pieces
    rng = random.Random(5)
    for _ in range(100):
        ids = [SPECIAL.cls] + [rng.choice([rng.randrange(10, 50), rng.randrange(50, 100)]) for _ in range(40)]
        ids[1] = 20  # a word start
        ids.append(SPECIAL.sep)
        masked = set(mask_instance(ids, 0.15, 20, SPECIAL, 100, rng, continuation).masked_positions)
        for pos in masked:
            if continuation[ids[pos]]:
                assert pos - 1 in masked  # a piece is never masked without the piece before it
            if pos + 1 < len(ids) and continuation[ids[pos + 1]]:
                assert pos + 1 in masked


def test_a_trained_vocab_is_the_same_file_every_time(tmp_path) -> None:
    """`tokenizers`' trainer alone kept three different token sets in three trainings of this corpus in one process
    (ties between equal merge counts broken by ids given in hash-map order); a test that learns from the corpus then
    learned less on one machine than on another. The digest is the file every process on every machine writes."""
    lines = write_facts_corpus(tmp_path / "facts.txt").read_text(encoding="utf-8").splitlines()
    digests = {train_vocab(lambda: iter(lines), 400, True, tmp_path / f"vocab{run}.txt").sha256 for run in range(4)}
    assert digests == {FACTS_VOCAB_SHA256}


def test_the_alphabet_cut_keeps_the_most_frequent_characters_and_breaks_ties_by_code_point(tmp_path) -> None:
    """1,200 CJK characters seen once each (the pre-tokenizer splits each off as a word) beside a few frequent
    letters: the 1,000-character alphabet keeps the letters and the lowest code points of the tie, every time; each
    letter can continue a word ("##b"), no CJK character can."""
    rare = [chr(0x4E00 + offset) for offset in range(1200)]
    lines = ["abc cab bca " * 3, " ".join(rare)]
    vocabs = {tuple(train_vocab(lambda: iter(lines), 1100, True, tmp_path / f"vocab{run}.txt").tokens)
              for run in range(3)}
    (tokens,) = vocabs
    kept = [char for char in rare if char in tokens]
    assert kept == rare[:1000 - 3]  # the alphabet's other three places: a, b, c
    assert {"a", "b", "c", "##b", "##c", "##a"} <= set(tokens) and not any(t == f"##{c}" for t in tokens for c in rare)
