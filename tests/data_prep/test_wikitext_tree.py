"""The page's text read from the tokens (data_prep/wikitext_tree.py) is exactly the text of mwparserfromhell's
tree after the cleaner's pruning, on the real dumps and on crafted and random markup."""

from __future__ import annotations

import hashlib
import random

import mwparserfromhell
import pytest
from mwparserfromhell.parser import ParserError

from data_prep import clean
from data_prep.clean import (
    _EMPTY_PARENS,
    _LEFTOVER_FILE,
    _LEFTOVER_MARKS,
    _LEFTOVER_TAG,
    _LEFTOVER_TEMPLATE,
    _MULTISPACE,
    _SPACE_BEFORE_PUNCT,
    DROP_RULES,
    _scrub,
    plain_text,
    wikitext_to_paragraphs,
)
from data_prep.sources import read_wiki_dump
from data_prep.wikitext_scan import strip_leftover_refs, unwrap_leftover_links
from data_prep.wikitext_tree import page_text

# Where the dropped nodes' text is read before they are dropped (a link's title, a tag's name, an attribute's
# name), nested drops, drops inside kept nodes, and markup the tokenizer gives up on.
CRAFTED = [
    "a {{b|c=[[d|e]]|{{f}}}} g",
    "[[{{lang}}:Page|text]] and [[{{x}}File:a.jpg|thumb|cap [[y]]]] and [[Image:{{z}}.png]]",
    "<{{x}}>a</{{x}}> <b {{y}}=1>bold {{t}}</b>",
    "== Head {{t}} ==\ntext\n=== [[Sub]] ===\nmore",
    "{| class=x\n|-\n| a {{t}} || {|\n| nested\n|}\n|}\nafter <b>{|\n|in bold\n|}</b>",
    "<gallery>\nFile:a.jpg|[[x]]\n</gallery> <math>x^{2}</math> <MATH>y</MATH> < pre >p</ pre > <pre/>",
    "<gallery> never closed {{t}} [[x|y]]",
    "{{unclosed [[link]] text",
    "<references/> <score>c</score><noinclude>{{doc}}</noinclude> <code>{{x}}</code> <span>kept {{t}}</span>",
    "* item {{t}}\n# [[a|b]] <small>{{c}}</small>\n: ''it'' '''b'''",
    "[http://x.org {{t}}] [http://y.org] {{{arg|{{t}}}}}",
    "<div {{a}}>x</div><ref name={{n}}>r</ref><table><tr><td>{{t}}</td></tr></table>",
    "[[A&amp;B]] [[de:X]] [[:Category:Y|see]] &nbsp;a&#32;b&#x41; <b>x</b <i>unclosed [[l|{{t}}]]",
    "\n\n\n[[a|\n\n\n\nb\n\n]]<span>\n\n\n\nc\n</span>\n\n\n\n",
]
PIECES = ["{{", "}}", "[[", "]]", "|", "=", "==", "\n", "{|", "|}", "|-", "<b>", "</b>", "<table>", "</table>",
          "<gallery>", "</gallery>", "<math>", "<br/>", "File:", "de:", "x", " ", "''", "[http://a.b ", "]", "'''", "&amp;", "{{{", "}}}", "<span a=", "\"", ":"]


def stock_and_pruned(text: str) -> tuple[str, str]:
    return plain_text(mwparserfromhell.parse(text)), page_text(text, DROP_RULES)


def test_crafted_markup_gives_the_stock_text() -> None:
    for text in CRAFTED:
        stock, pruned = stock_and_pruned(text)
        assert pruned == stock, repr(text)


def test_random_markup_gives_the_stock_text() -> None:
    rng = random.Random(54)
    for _ in range(1500):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))
        stock, pruned = stock_and_pruned(text)
        assert pruned == stock, repr(text)


# sha256 of every article's cleaned paragraphs ("\n"-joined, then a NUL) over the sample dumps, in file order,
# recorded with the tree-building cleaner of commit 2b189bd (before the token reader).
SAMPLE_DUMPS_CLEANED = "76b66faf22794cc65c3e3f3e22366b9bacaa16dd3491fab0dd7002ae83b15ef1"


@pytest.mark.shared_data
def test_real_dumps_clean_to_the_recorded_text(shared_data) -> None:
    digest, pages = hashlib.sha256(), 0
    for dump in sorted((shared_data / "wikipedia").glob("*.xml*.bz2")):
        for doc in read_wiki_dump(dump):
            digest.update(("\n".join(wikitext_to_paragraphs(doc.text)) + "\x00").encode())
            pages += 1
    assert (pages, digest.hexdigest()) == (103, SAMPLE_DUMPS_CLEANED)


LINE_PIECES = ["<ref>", "</ref>", "<b>", "[[", "]]", "[[File:a", "{{", "}}", "''", "'", "(", ")", " ", "  ", "\t",
               "\u00a0", ",", ".", "x", "|", ";", "*", "#", ":"]


def test_each_line_is_scrubbed_as_by_every_step() -> None:
    """`_scrub` skips the steps whose pattern cannot match: the same line as running them all."""
    rng = random.Random(7)
    for _ in range(4000):
        line = "".join(rng.choice(LINE_PIECES) for _ in range(rng.randint(0, 20)))
        every = _LEFTOVER_FILE.sub("", strip_leftover_refs(line))
        every = unwrap_leftover_links(_LEFTOVER_TEMPLATE.sub("", every))
        every = _LEFTOVER_MARKS.sub("", _LEFTOVER_TAG.sub("", every)).lstrip("*#:; ").strip()
        every = _SPACE_BEFORE_PUNCT.sub(r"\1", _MULTISPACE.sub(" ", _EMPTY_PARENS.sub("", every))).strip()
        assert _scrub(line) == every, repr(line)


def test_a_page_the_token_reader_cannot_read_is_cleaned_by_the_librarys_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader is a faster path to the tree's text, not a new judge of pages: where it meets a token layout it
    does not know (ParserError), the page is cleaned from mwparserfromhell's tree, as before it, not lost."""
    page = CRAFTED[1]
    expected = wikitext_to_paragraphs(page)

    def unknown_layout(wikitext: str, rules: object) -> str:
        raise ParserError("unexpected TagAttrStart at token 3")

    monkeypatch.setattr(clean, "page_text", unknown_layout)
    assert expected and wikitext_to_paragraphs(page) == expected
