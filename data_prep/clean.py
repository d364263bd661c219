"""Wikitext -> plain text with mwparserfromhell (a maintained parser, not regexes over markup).

Removed: templates (infoboxes, citations, navboxes), headings, tables, <ref>/<gallery>/<math>
and other non-prose tags, File/Image/Category links, interlanguage links, comments.
Kept: the visible text of ordinary links, bold/italic text, list items' text.
`bench/data_prep_throughput.py --parsers` measures this against `wikitextparser`.
"""

from __future__ import annotations

import re

import mwparserfromhell
from mwparserfromhell.nodes import Comment, Heading, Tag, Template, Wikilink

# Tags whose content is never running prose.
_DROP_TAGS = frozenset(
    {"ref", "references", "table", "gallery", "math", "chem", "score", "timeline", "imagemap",
     "syntaxhighlight", "source", "pre", "code", "hiero", "graph", "mapframe", "templatedata", "noinclude"}
)
_DROP_LINK_PREFIXES = ("file:", "image:", "category:", "media:", "wikt:", "wiktionary:", "s:", "commons:")
# Interlanguage links look like [[de:Anarchismus]]: a short lowercase prefix and a colon.
_INTERLANGUAGE = re.compile(r"^[a-z]{2,3}(-[a-z]+)?:")
_DISAMBIGUATION = re.compile(
    r"\{\{\s*(disambiguation|disambig|dab|hndis|geodis|numberdis|letter[- ]disambiguation|"
    r"surname|given name|set index article|sia|shipindex|hospitaldis|schooldis|mountainindex)\s*[|}]",
    re.IGNORECASE,
)
# <ref>s and comments cannot nest in MediaWiki, so a regex removes them exactly, and before
# parsing: they are ~30% of an article's wikitext and building their nodes is most of the cost
# (halves the cleaning time on the sample dump).
_REFS_AND_COMMENTS = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?</ref\s*>|<!--.*?-->", re.IGNORECASE | re.DOTALL)
_REDIRECT = re.compile(r"^\s*#redirect", re.IGNORECASE)
# Leftovers that strip_code can leave when markup is malformed in the source page.
_RESIDUE_LINE = re.compile(r"^\s*(\{\||\|\}|\|-|!|\||\{\{|\}\}|<|__[A-Z]+__)")
# Markup that survives when the source page itself is unbalanced (an unclosed '' or <ref>
# makes the parser read what follows as text): scrubbed from the final text.
_LEFTOVER_REF = re.compile(r"<ref[^>]*?/>|<ref[^>]*>.*?(</ref>|$)", re.IGNORECASE)
_LEFTOVER_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_LEFTOVER_FILE = re.compile(r"\[\[(file|image|category):[^\n]*", re.IGNORECASE)
_LEFTOVER_LINK = re.compile(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]")
_LEFTOVER_TAG = re.compile(r"</?[a-zA-Z][^<>]*>")
_LEFTOVER_MARKS = re.compile(r"''+|\[\[|\]\]|\{\{|\}\}")
_MULTISPACE = re.compile(r"[ \t\u00a0]+")
_EMPTY_PARENS = re.compile(r"\(\s*[,;]?\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")


def is_redirect(wikitext: str) -> bool:
    return bool(_REDIRECT.match(wikitext))


def is_disambiguation(title: str, wikitext: str) -> bool:
    return title.endswith("(disambiguation)") or bool(_DISAMBIGUATION.search(wikitext))


def _drop_node(node: object) -> bool:
    if isinstance(node, Template | Heading | Comment):
        return True
    if isinstance(node, Tag):
        return str(node.tag).strip().lower() in _DROP_TAGS
    if isinstance(node, Wikilink):
        target = str(node.title).strip().lower().lstrip(":")
        return target.startswith(_DROP_LINK_PREFIXES) or bool(_INTERLANGUAGE.match(target))
    return False


def _prune(code: mwparserfromhell.wikicode.Wikicode) -> None:
    """Drop unwanted nodes at every depth, rebuilding each node list once.

    Headings, tables and File/Category links usually sit at the top level, but an unclosed tag
    earlier in a page nests the rest of it, so the walk goes down. Rebuilding the lists is O(n);
    Wikicode.remove() searches the whole tree for every node it removes.
    """
    code.nodes = [node for node in code.nodes if not _drop_node(node)]
    for node in code.nodes:
        for child in node.__children__():
            _prune(child)


def wikitext_to_paragraphs(wikitext: str) -> list[str]:
    """Plain-text paragraphs of one article, markup removed, in page order."""
    code = mwparserfromhell.parse(_REFS_AND_COMMENTS.sub("", wikitext))
    _prune(code)
    text = code.strip_code(normalize=True, collapse=True, keep_template_params=False)
    paragraphs = []
    for line in text.split("\n"):
        if _RESIDUE_LINE.match(line):
            continue
        line = _LEFTOVER_FILE.sub("", _LEFTOVER_REF.sub("", line))
        line = _LEFTOVER_LINK.sub(r"\1", _LEFTOVER_TEMPLATE.sub("", line))
        line = _LEFTOVER_MARKS.sub("", _LEFTOVER_TAG.sub("", line))
        line = line.lstrip("*#:; ").strip()
        line = _EMPTY_PARENS.sub("", line)
        line = _SPACE_BEFORE_PUNCT.sub(r"\1", _MULTISPACE.sub(" ", line)).strip()
        if line:
            paragraphs.append(line)
    return paragraphs
