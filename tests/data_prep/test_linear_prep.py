"""Cleaning is linear in its input, whatever the input: vandalised wikitext is cleaned in linear time or
refused before the parser rescans it, and a refused page is named, or skipped and counted.

The scans that replace the regexes must give the regexes' exact output (the recorded shard digests of
test_nsp_unchanged.py and the sample dump's pages say so for real text; random markup here for the corners).
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections.abc import Callable

import pytest

from data_prep.__main__ import main
from data_prep.clean import _EMPTY_PARENS, _SPACE_BEFORE_PUNCT, CostlyPage, wikitext_to_paragraphs
from data_prep.config import DocumentLimits
from data_prep.corpus_index import DOCUMENTS_SKIPPED
from data_prep.documents import RawDocument, document_sentences
from data_prep.sentences import _ABBREVIATIONS, split_sentences
from data_prep.source_files import DocumentTooLarge
from data_prep.time_limit import time_limit
from data_prep.wikitext_scan import strip_leftover_refs, strip_refs_and_comments, unwrap_leftover_links
from tests.support.data_prep_fixtures import write_vocab, write_wiki_dump

# What the scans replace, as the code had them.
REFS_AND_COMMENTS = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?</ref\s*>|<!--.*?-->", re.IGNORECASE | re.DOTALL)
LEFTOVER_REF = re.compile(r"<ref[^>]*?/>|<ref[^>]*>.*?(</ref>|$)", re.IGNORECASE)
LEFTOVER_LINK = re.compile(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]")
EMPTY_PARENS = re.compile(r"\(\s*[,;]?\s*\)")
SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")

REF_PIECES = ["<ref", "<REF", "<Ref name=a", "<ref/>", "<refs", "/", ">", "/>", "</ref>", "</ref >", "</REF\n>",
              "</ref", "<!--", "-->", "--", "-", "<", "x", " ", "\n", "<references/>", "é"]
LINK_PIECES = ["[[", "]]", "]", "[", "|", "x", " ", "a|b"]
SPACE_PIECES = ["(", ")", " ", "\u2003", ",", ";", ".", "!", "x"]


def random_texts(pieces: list[str], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 24))) for _ in range(count)]


@pytest.mark.parametrize(("scan", "reference", "pieces"), [
    (strip_refs_and_comments, lambda t: REFS_AND_COMMENTS.sub("", t), REF_PIECES),
    (strip_leftover_refs, lambda t: LEFTOVER_REF.sub("", t), [p for p in REF_PIECES if "\n" not in p]),
    (unwrap_leftover_links, lambda t: LEFTOVER_LINK.sub(r"\1", t), LINK_PIECES),
    (lambda t: _EMPTY_PARENS.sub("", t), lambda t: EMPTY_PARENS.sub("", t), SPACE_PIECES),
    (lambda t: _SPACE_BEFORE_PUNCT.sub(r"\1", t), lambda t: SPACE_BEFORE_PUNCT.sub(r"\1", t), SPACE_PIECES),
], ids=["refs-and-comments", "leftover-refs", "leftover-links", "empty-parens", "space-before-punct"])
def test_each_scan_gives_exactly_what_its_regex_gave(scan: Callable[[str], str], reference: Callable[[str], str],
                                                     pieces: list[str]) -> None:
    for text in random_texts(pieces, 4000, seed=len(pieces)):
        assert scan(text) == reference(text), repr(text)


def growth(work: Callable[[str], object], small: str, large: str) -> float:
    """Seconds per call on `large` over seconds per call on `small`: each the best of three runs of at least
    20 ms (calls repeated), so that the machine's noise does not decide."""
    def per_call(text: str) -> float:
        best = float("inf")
        for _ in range(3):
            calls, started = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - started) < 0.02 or calls == 0:
                work(text)
                calls += 1
            best = min(best, elapsed / calls)
        return best
    return per_call(large) / per_call(small)


@pytest.mark.parametrize(("scan", "unit"), [
    (strip_refs_and_comments, "<ref>x "), (strip_refs_and_comments, "<!-- x "),
    (strip_refs_and_comments, "<ref name=a x "), (strip_refs_and_comments, "<ref<ref "),
    (strip_leftover_refs, "<ref<ref "), (strip_leftover_refs, "<ref x/>y "),
    (unwrap_leftover_links, "[[x "), (unwrap_leftover_links, "[[x] "),
])
def test_unclosed_refs_comments_and_links_are_scanned_in_linear_time(scan: Callable[[str], str], unit: str) -> None:
    """4x the openers, about 4x the time (the regexes: 14x from 2,000 to 8,000 unclosed <ref>s). A growth
    ratio measured in this test, not a time bound."""
    ratio = growth(scan, unit * 10_000, unit * 40_000)
    assert ratio < 8, f"{scan.__name__} on {unit!r}: 4x input took {ratio:.1f}x the time"


OLD_BOUNDARY = re.compile(r"([.!?]+[\"'\u201d\u2019)\]]*)\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9\u00c0-\u024f])")


def old_split_sentences(paragraph: str) -> list[str]:
    """data_prep.sentences.split_sentences as it was: the boundary tried at every position, the last word
    searched for from the sentence's start."""
    sentences, start = [], 0
    for match in OLD_BOUNDARY.finditer(paragraph):
        if match.group(1) == ".":
            word = re.search(r"([\w.]+)$", paragraph[start : match.start() + 1])
            last = word.group(1).rstrip(".").lower() if word else ""
            if word and (last in _ABBREVIATIONS or (len(last) == 1 and last.isalpha())):
                continue
        if sentence := paragraph[start : match.end(1)].strip():
            sentences.append(sentence)
        start = match.end()
    return sentences + ([paragraph[start:].strip()] if paragraph[start:].strip() else [])


def test_sentence_splitting_gives_what_it_gave() -> None:
    pieces = ["Mr.", " ", "A", "x", ".", "..", "e.g.", "J.", "!", "?", '"', "\u201d", ")", "(", "é", "1", "\u2003", "B"]
    for text in random_texts(pieces, 4000, seed=7):
        assert split_sentences(text) == old_split_sentences(text), repr(text)


def test_sentence_splitting_is_linear_in_abbreviations() -> None:
    """A paragraph of abbreviations kept the sentence start in place, and every boundary searched the whole
    text before it for its last word (8,000 of "Mr. A": 24 s)."""
    small, large = "Mr. A " * 4_000, "Mr. A " * 16_000
    assert split_sentences(small) == [small.strip()]
    ratio = growth(split_sentences, small, large)
    assert ratio < 8, f"4x the abbreviations took {ratio:.1f}x the time"
    # a last word longer than the first look back: it is read whole ("b...b.mr" is no abbreviation)
    assert split_sentences("See " + "b" * 100 + ".mr. Then it ends.") == ["See " + "b" * 100 + ".mr.", "Then it ends."]
    # a run of dots was tried at every dot (40,000: 35 s)
    assert growth(split_sentences, "x" + "." * 10_000 + " Y", "x" + "." * 40_000 + " Y") < 8


@pytest.mark.parametrize("page", [
    "<ref>x " * 8000,  # 55 KiB: 3.4 s in the regex, then minutes in the parser
    "{{a|x " * 4000,  # 23 KiB: 11.6 s in the parser
    "<ref x " * 1000 + "Prose. " * 100,  # a tag that never closes its '>': 2.6 s
    "[http://a.b x " * 2000,  # 1.5 s
    "{|\n| x\n" * 2000,  # 0.9 s
])
def test_a_vandalised_page_is_refused_before_it_is_parsed(page: str) -> None:
    with pytest.raises(CostlyPage, match="unclosed"):
        wikitext_to_paragraphs(page)


def test_real_markup_at_the_cap_still_parses() -> None:
    """A balanced page is never refused, however long up to MediaWiki's limit; a few stray openers are fine."""
    prose = "The [[river|River]] flows {{convert|3|km}} east.<ref>{{cite web|url=x}}</ref> <br> Done. "
    assert len(wikitext_to_paragraphs(prose * 200)) == 1
    wikitext_to_paragraphs("{{unclosed|" + prose * 50)  # one unclosed opener in 5 KiB: parsed, not refused


def test_a_page_over_a_cap_is_named_or_skipped(capsys) -> None:
    doc = RawDocument("wiki:dump.xml", "Vandalised", "{{a|x " * 4000, "wikitext")
    with pytest.raises(DocumentTooLarge, match=r"wiki:dump.xml: 'Vandalised': 4,000 unclosed"):
        document_sentences(doc, skip_bad_files=False)
    assert document_sentences(doc, skip_bad_files=True) is None
    assert "warning: skipped (--skip-bad-files): wiki:dump.xml: 'Vandalised'" in capsys.readouterr().err
    big = RawDocument("wiki:dump.xml", "Huge", "word " * 300, "wikitext")
    with pytest.raises(DocumentTooLarge, match="1,500 characters of wikitext, over the 1,000"):
        document_sentences(big, False, DocumentLimits(max_wikitext_chars=1000))


def test_the_time_limit_stops_a_cost_the_counts_do_not_see() -> None:
    """The last resort: a regex-heavy document interrupted by the worker's timer, named with the reason."""
    doc = RawDocument("text:x.txt", "x.txt#1", "Mr. A " * 400_000, "paragraph_lines")
    with pytest.raises(DocumentTooLarge, match="not cleaned within 0.05 s"):
        document_sentences(doc, False, DocumentLimits(parse_seconds=0.05))


def test_the_time_limit_leaves_another_timer_alone() -> None:
    """A timer the process already runs (a test runner's, say) is neither replaced nor cancelled."""
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        with time_limit(0.05):
            assert signal.getitimer(signal.ITIMER_REAL)[0] > 50
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 50
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with time_limit(0.05):
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.05
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_a_build_names_a_vandalised_page_or_skips_and_counts_it(tmp_path, capsys) -> None:
    dump = tmp_path / "dump.xml"
    write_wiki_dump(dump, articles=6)
    text = dump.read_text(encoding="utf-8")
    vandalised = ("<page><title>Vandalised</title><ns>0</ns><id>99</id><revision><text>"
                  + "{{a|x " * 4000 + "</text></revision></page>")
    dump.write_text(text.replace("</mediawiki>", vandalised + "</mediawiki>"), encoding="utf-8")
    write_vocab(tmp_path / "vocab.txt")
    flags = ["build", "--wiki-dump", str(dump), "--vocab", str(tmp_path / "vocab.txt"), "--seq-lens", "64",
             "--num-shards", "1", "--workers", "1"]
    assert main([*flags, "--out", str(tmp_path / "strict")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "wiki:dump.xml: 'Vandalised': 4,000 unclosed" in errors[0], errors
    assert main([*flags, "--out", str(tmp_path / "lenient"), "--skip-bad-files"]) == 0
    totals = json.loads((tmp_path / "lenient" / "manifest.json").read_text(encoding="utf-8"))["totals"]
    assert totals[DOCUMENTS_SKIPPED] == 1 and totals["input_documents"] == 7
    assert "warning: skipped (--skip-bad-files): wiki:dump.xml: 'Vandalised'" in capsys.readouterr().err
