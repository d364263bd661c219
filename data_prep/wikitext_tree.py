"""A page's plain text read straight from mwparserfromhell's tokens, without building the nodes that hold it.

mwparserfromhell parses in two steps: its C tokenizer turns the page into a flat list of tokens, then a
pure-Python builder turns every token into a node (a Text node per run of text, a Wikicode and a list per
level). The cleaner then dropped the nodes that are not prose and asked the rest for their text
(`strip_code`): on the sample dump, building and walking the tree was most of the cleaning time.

Here the tokens are read once, level by level, into what `strip_code` would give for each node after the
cleaner's pruning (data_prep/clean.py: `plain_text`): text as it is; a template, heading or comment, and a
tag or link that the rules drop, as nothing (their tokens skipped as one balanced span); a link as its
text, else its title; a tag as its contents when the tag is visible; every level's text with its newlines
trimmed and collapsed as `strip_code` trims them. What decides a drop is read as the tree would give it:
a link's title or a tag's name is joined from its text tokens, and built by the library's builder when it
holds anything else. The rarer nodes (external links, entities, template arguments) are built by the
library and stripped as before. tests/data_prep/test_wikitext_tree.py compares the text with the tree's on
the sample dumps, crafted and random markup.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from mwparserfromhell.definitions import is_visible
from mwparserfromhell.parser import Parser, ParserError
from mwparserfromhell.parser import tokens as T
from mwparserfromhell.parser.builder import Builder
from mwparserfromhell.wikicode import Wikicode

# Each opener's closers: a span is balanced per kind (the builder relies on it too).
_CLOSERS: dict[type, tuple[type, ...]] = {
    T.TemplateOpen: (T.TemplateClose,), T.ArgumentOpen: (T.ArgumentClose,), T.WikilinkOpen: (T.WikilinkClose,),
    T.ExternalLinkOpen: (T.ExternalLinkClose,), T.HTMLEntityStart: (T.HTMLEntityEnd,),
    T.HeadingStart: (T.HeadingEnd,), T.CommentStart: (T.CommentEnd,),
    T.TagOpenOpen: (T.TagCloseSelfclose, T.TagCloseClose),
}
_SKIPPED = (T.TemplateOpen, T.HeadingStart, T.CommentStart)  # dropped wherever they are
_BUILT = (T.ExternalLinkOpen, T.HTMLEntityStart, T.ArgumentOpen)  # built and stripped by the library
_TITLE_ENDS = (T.WikilinkSeparator, T.WikilinkClose)
_TAG_NAME_ENDS = (T.TagAttrStart, T.TagCloseOpen, T.TagCloseSelfclose)
_ATTRIBUTE_ENDS = (T.TagAttrEquals, T.TagAttrQuote, *_TAG_NAME_ENDS)
_CONTENTS_ENDS = (T.TagOpenClose, T.TagCloseClose)
_STRIP = {"normalize": True, "collapse": True, "keep_template_params": False}


@dataclass(frozen=True)
class DropRules:
    """What the cleaner drops besides templates, headings and comments: tags by name (`str(tag.tag)` stripped
    and lower-cased, in `tags`), links by title (`link(str(link.title))`); and its pruning of a built node's
    children (`prune`, for the nodes built by the library)."""

    tags: Collection[str]
    link: Callable[[str], bool]
    prune: Callable[[Wikicode], None]


def collapse(text: str) -> str:
    """`Wikicode.strip_code(collapse=True)`'s last step, on one level's joined text."""
    text = text.strip("\n")
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


class _Reader:
    """The tokens of one page, read left to right by `level` (one Wikicode's worth) and the node readers."""

    def __init__(self, tokens: list[Any], rules: DropRules) -> None:
        self.tokens = tokens
        self.rules = rules
        self.at = 0

    def level(self, ends: tuple[type, ...]) -> str:
        """The text of the nodes from here to the first token of a kind in `ends` (left unread)."""
        tokens, pieces, text = self.tokens, [], T.Text
        while self.at < len(tokens):
            token = tokens[self.at]
            kind = type(token)
            if kind is text:  # most tokens: a token is a dict, read as one (its attributes go through __getattr__)
                pieces.append(token["text"])
                self.at += 1
            elif kind in ends:
                break
            elif kind is T.WikilinkOpen:
                pieces.append(self.wikilink())
            elif kind is T.TagOpenOpen:
                pieces.append(self.tag())
            elif kind in _SKIPPED:
                self.at = self.span_end(self.at)
            elif kind in _BUILT:
                pieces.append(self.built())
            else:
                raise ParserError(f"unexpected {kind.__name__} at token {self.at}")
        return collapse("".join(pieces))

    def span_end(self, start: int) -> int:
        """Just past the closer that balances the opener at `start`."""
        tokens, opens = self.tokens, type(self.tokens[start])
        closes = _CLOSERS[opens]
        depth, at = 1, start
        while depth:
            at += 1
            if at >= len(tokens):
                raise ParserError(f"{opens.__name__} without its closer")
            kind = type(tokens[at])
            if kind is opens:
                depth += 1
            elif kind in closes:
                depth -= 1
        return at + 1

    def source(self, start: int, end: int) -> str:
        """`str()` of the Wikicode the tokens start..end make: their text joined, or built when not all text."""
        span = self.tokens[start:end]
        parts = []
        for token in span:
            if type(token) is not T.Text:
                return str(Builder().build(span))
            parts.append(token["text"])
        return "".join(parts)

    def wikilink(self) -> str:
        """`Wikilink.__strip__`: its text when it has a separator, else its title; nothing when dropped."""
        self.at += 1
        title_start = self.at
        title = self.level(_TITLE_ENDS)
        title_end = self.at
        text = None
        if type(self.tokens[self.at]) is T.WikilinkSeparator:
            self.at += 1
            text = self.level((T.WikilinkClose,))
        self.at += 1
        if self.rules.link(self.source(title_start, title_end)):
            return ""
        return title if text is None else text

    def tag(self) -> str:
        """`Tag.__strip__`: its contents when the tag is visible; nothing for a self-closing or dropped tag."""
        start = self.at
        self.at += 1
        self.level(_TAG_NAME_ENDS)
        name = self.source(start + 1, self.at)
        if name.strip().lower() in self.rules.tags:
            self.at = self.span_end(start)
            return ""
        while type(self.tokens[self.at]) is not T.TagCloseOpen:  # attributes: read past, never text
            if type(self.tokens[self.at]) is T.TagCloseSelfclose:
                self.at += 1
                return ""
            self.at += 1
            self.level(_ATTRIBUTE_ENDS)
        self.at += 1
        contents = self.level(_CONTENTS_ENDS)
        has_contents = type(self.tokens[self.at]) is T.TagOpenClose
        if has_contents:
            self.at += 1
            self.level((T.TagCloseClose,))  # the closing tag's name
        self.at += 1
        return contents if has_contents and is_visible(name) else ""

    def built(self) -> str:
        """A rarer node as before: built by the library, its children pruned, stripped."""
        end = self.span_end(self.at)
        node = Builder().build(self.tokens[self.at : end]).nodes[0]
        self.at = end
        for child in node.__children__():
            self.rules.prune(child)
        stripped = node.__strip__(**_STRIP)
        return str(stripped) if stripped else ""


def page_text(wikitext: str, rules: DropRules) -> str:
    """`strip_code` of the page's tree after the cleaner's pruning (module doc), read from its tokens."""
    tokens = Parser()._tokenizer.tokenize(wikitext, 0, False)  # what mwparserfromhell.parse() builds from
    reader = _Reader(tokens, rules)
    text = reader.level(())
    if reader.at != len(tokens):
        raise ParserError(f"tokens left after the page at {reader.at}")
    return text

