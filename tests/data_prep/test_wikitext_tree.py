"""The pruned parse (data_prep/wikitext_tree.py) gives the cleaner exactly the text of mwparserfromhell's own
parse, on the real dumps and on crafted and random markup, while building no node it drops."""

from __future__ import annotations

import random

import mwparserfromhell
import pytest
from mwparserfromhell.nodes import Heading, Tag, Template

from data_prep.clean import DROP_TAGS, plain_text
from data_prep.sources import read_wiki_dump
from data_prep.wikitext_scan import strip_refs_and_comments
from data_prep.wikitext_tree import Dropped, parse_pruned

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
]
PIECES = ["{{", "}}", "[[", "]]", "|", "=", "==", "\n", "{|", "|}", "|-", "<b>", "</b>", "<table>", "</table>",
          "<gallery>", "</gallery>", "<math>", "<br/>", "File:", "de:", "x", " ", "''", "[http://a.b ", "]", "'''"]


def stock_and_pruned(text: str) -> tuple[str, str]:
    return plain_text(mwparserfromhell.parse(text)), plain_text(parse_pruned(text, DROP_TAGS))


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


def test_dropped_nodes_are_not_built_until_read() -> None:
    code = parse_pruned("x {{a|b=[[c]]}} <math>y</math>\n== H ==\n<b>z</b>", DROP_TAGS)
    dropped = [node for node in code.nodes if isinstance(node, Dropped)]
    assert len(dropped) == 3 and not any(isinstance(n, Template | Heading) for n in code.nodes)
    assert all(node._node is None for node in dropped)  # nothing built yet
    assert [type(node.real()) for node in dropped] == [Template, Tag, Heading]
    assert str(code) == "x {{a|b=[[c]]}} <math>y</math>\n== H ==\n<b>z</b>"  # the page's text, as parsed


@pytest.mark.shared_data
def test_real_dumps_give_the_stock_text(shared_data) -> None:
    pages = 0
    for dump in sorted((shared_data / "wikipedia").glob("*.xml*.bz2")):
        for doc in read_wiki_dump(dump):
            stock, pruned = stock_and_pruned(strip_refs_and_comments(doc.text))
            assert pruned == stock, doc.title
            pages += 1
    assert pages > 100
