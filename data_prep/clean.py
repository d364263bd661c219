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
from mwparserfromhell.parser import ParserError

from data_prep.config import DEFAULT_LIMITS, DocumentLimits
from data_prep.wikitext_scan import (
    strip_leftover_refs,
    strip_refs_and_comments,
    unclosed_openers,
    unwrap_leftover_links,
)
from data_prep.wikitext_tree import DropRules, page_text

# Tags whose content is never running prose.
DROP_TAGS = frozenset(
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
# <ref>s and comments cannot nest in MediaWiki, so they are removed exactly before parsing, by a linear scan
# (data_prep/wikitext_scan.py): they are ~30% of an article's wikitext and building their nodes is most of the
# cost (halves the cleaning time on the sample dump).
_REDIRECT = re.compile(r"^\s*#redirect", re.IGNORECASE)
# Leftovers that strip_code can leave when markup is malformed in the source page.
_RESIDUE_LINE = re.compile(r"^\s*(\{\||\|\}|\|-|!|\||\{\{|\}\}|<|__[A-Z]+__)")
# Markup that survives when the source page itself is unbalanced (an unclosed '' or <ref>
# makes the parser read what follows as text): scrubbed from the final text.
_LEFTOVER_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_LEFTOVER_FILE = re.compile(r"\[\[(file|image|category):[^\n]*", re.IGNORECASE)
_LEFTOVER_TAG = re.compile(r"</?[a-zA-Z][^<>]*>")
_LEFTOVER_MARKS = re.compile(r"''+|\[\[|\]\]|\{\{|\}\}")
_MULTISPACE = re.compile(r"[ \t\u00a0]+")
# Both written so that a long run of whitespace is tried once, not once per position (linear, same matches).
_EMPTY_PARENS = re.compile(r"\((?:\s*[,;])?\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"(?<!\s)\s++([,.;:!?])")


class CostlyPage(ValueError):
    """A page over a cap (data_prep/config.py: DocumentLimits), found before it is parsed; says why."""


def is_redirect(wikitext: str) -> bool:
    return bool(_REDIRECT.match(wikitext))


def is_disambiguation(title: str, wikitext: str) -> bool:
    return title.endswith("(disambiguation)") or bool(_DISAMBIGUATION.search(wikitext))


def _drop_node(node: object) -> bool:
    if isinstance(node, Template | Heading | Comment):
        return True
    if isinstance(node, Tag):
        return str(node.tag).strip().lower() in DROP_TAGS
    if isinstance(node, Wikilink):
        return _drop_link(str(node.title))
    return False


def _drop_link(title: str) -> bool:
    """A File/Category/... or interlanguage link, by its title as written."""
    target = title.strip().lower().lstrip(":")
    return target.startswith(_DROP_LINK_PREFIXES) or bool(_INTERLANGUAGE.match(target))


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


def plain_text(code: mwparserfromhell.wikicode.Wikicode) -> str:
    """A parsed page's text: the nodes that are not prose dropped, the rest stripped of its markup. What
    `page_text` gives without building the tree (the reference its tests compare with)."""
    _prune(code)
    return code.strip_code(normalize=True, collapse=True, keep_template_params=False)


DROP_RULES = DropRules(DROP_TAGS, _drop_link, _prune)


def check_page(wikitext: str, limits: DocumentLimits) -> None:
    """Refuse, in linear time, a page whose parse would take superlinear time: with so many unclosed openers
    that the parser's rescans of the rest of the page (one per opener) pass the cap."""
    unclosed = unclosed_openers(wikitext)
    if unclosed * len(wikitext) > limits.max_markup_cost:
        raise CostlyPage(f"{unclosed:,} unclosed templates, links, tables or tags in {len(wikitext):,} characters "
                         f"(vandalised or broken markup; parsing it takes time that grows with their product, "
                         f"capped at {limits.max_markup_cost:,})")


def wikitext_to_paragraphs(wikitext: str, limits: DocumentLimits = DEFAULT_LIMITS) -> list[str]:
    """Plain-text paragraphs of one article, markup removed, in page order; CostlyPage for a page over a cap."""
    if len(wikitext) > limits.max_wikitext_chars:
        raise CostlyPage(f"{len(wikitext):,} characters of wikitext, over the {limits.max_wikitext_chars:,} "
                         "MediaWiki allows")
    wikitext = strip_refs_and_comments(wikitext)
    check_page(wikitext, limits)
    try:
        text = page_text(wikitext, DROP_RULES)  # plain_text(mwparserfromhell.parse(wikitext)), read from the tokens
    except ParserError:  # a token layout the reader does not know: the library's tree, as every build before
        text = plain_text(mwparserfromhell.parse(wikitext))
    paragraphs = []
    for line in text.split("\n"):
        if not _RESIDUE_LINE.match(line):
            line = _scrub(line)
            if line:
                paragraphs.append(line)
    return paragraphs


def _scrub(line: str) -> str:
    """One line of stripped text with the markup a malformed page left removed and its spaces tidied. Each
    step runs only where its pattern could match (a literal every match holds is in the line): most lines
    hold no markup, and the steps are then the line unchanged."""
    if "<" in line:
        line = strip_leftover_refs(line)
    if "[[" in line:
        line = _LEFTOVER_FILE.sub("", line)
    if "{{" in line:
        line = _LEFTOVER_TEMPLATE.sub("", line)
    if "[[" in line:
        line = unwrap_leftover_links(line)
    if "<" in line:
        line = _LEFTOVER_TAG.sub("", line)
    if "'" in line or "[[" in line or "]]" in line or "{{" in line or "}}" in line:
        line = _LEFTOVER_MARKS.sub("", line)
    line = line.lstrip("*#:; ").strip()
    if "(" in line:
        line = _EMPTY_PARENS.sub("", line)
    if "  " in line or "\t" in line or "\u00a0" in line:
        line = _MULTISPACE.sub(" ", line)
    return _SPACE_BEFORE_PUNCT.sub(r"\1", line).strip()
