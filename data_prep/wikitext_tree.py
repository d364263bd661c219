"""mwparserfromhell's tree of a page, without building the nodes that the cleaner drops whole.

mwparserfromhell parses in two steps: its C tokenizer turns the page into a flat list of tokens, then a
pure-Python builder turns every token into a node. The cleaner (data_prep/clean.py) then drops every template,
heading and tag of a non-prose kind (tables, galleries, math, ...) wherever it sits, so building their nodes
(an infobox is hundreds of parameters and links) is work thrown away: on the sample dump the builder was the
larger part of cleaning.

Here the builder is the library's own, except that such a node's tokens are cut out of the list as one span
(a count of openers and closers, no node made) and kept in a `Dropped` node. The cleaner drops it as it drops
what it stands for; if anything asks for its text (`str`: the title of a link around it, whose target decides
whether the link is kept), the span is built then, by the library's builder, into the very node the library
would have made. So the tree the cleaner keeps, and the text, are exactly those of `mwparserfromhell.parse`
(tests/data_prep/test_wikitext_tree.py compares them on the sample dumps and on crafted markup).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

from mwparserfromhell.nodes import Node
from mwparserfromhell.parser import Parser, ParserError
from mwparserfromhell.parser import tokens as T
from mwparserfromhell.parser.builder import Builder
from mwparserfromhell.wikicode import Wikicode

_TAG_CLOSERS = (T.TagCloseSelfclose, T.TagCloseClose)
_TAG_NAME_ENDS = (T.TagAttrStart, T.TagCloseOpen, T.TagCloseSelfclose)


class Dropped(Node):
    """A template, heading or tag the cleaner drops, kept as its tokens; built into the library's node only
    when something reads it (its text, its children), so that whatever reads it sees what it would have."""

    def __init__(self, span: list[Any]) -> None:
        super().__init__()
        self._span = span
        self._node: Node | None = None

    def real(self) -> Node:
        if self._node is None:
            self._node = Builder().build(list(self._span)).nodes[0]
        return self._node

    def __str__(self) -> str:
        return str(self.real())

    def __children__(self) -> Iterator[Wikicode]:
        return self.real().__children__()

    def __strip__(self, **kwargs: Any) -> Any:
        return self.real().__strip__(**kwargs)

    def __showtree__(self, write: Callable[[str], None], get: Callable[[Wikicode], None],
                     mark: Callable[[], None]) -> None:
        self.real().__showtree__(write, get, mark)


class _PruningBuilder(Builder):
    """The library's builder, with templates, headings and tags named in `drop_tags` cut out as `Dropped`.

    The builder pops tokens from the end of `self._tokens` (the list reversed), so a span is found by walking
    from the end to the closer that balances its opener; the tokenizer only emits balanced spans (the builder
    itself relies on it)."""

    def __init__(self, drop_tags: Collection[str]) -> None:
        super().__init__()
        self._drop_tags = drop_tags

    def _handle_token(self, token: Any) -> Any:
        kind = type(token)
        if kind is T.TemplateOpen:
            return Dropped(self._take(token, kind, (T.TemplateClose,)))
        if kind is T.HeadingStart:
            return Dropped(self._take(token, kind, (T.HeadingEnd,)))
        if kind is T.TagOpenOpen and self._next_tag_name() in self._drop_tags:
            return Dropped(self._take(token, kind, _TAG_CLOSERS))
        return super()._handle_token(token)

    def _next_tag_name(self) -> str | None:
        """The name of the tag being opened, as the cleaner reads it (`str(tag.tag).strip().lower()`), when its
        tokens are plain text; None otherwise (then the tag is built as the library builds it)."""
        stack = self._tokens
        parts = []
        for index in range(len(stack) - 1, -1, -1):
            token = stack[index]
            if type(token) is T.Text:
                parts.append(token.text)
            elif isinstance(token, _TAG_NAME_ENDS):
                return "".join(parts).strip().lower()
            else:
                return None
        return None

    def _take(self, opener: Any, opens: type, closes: tuple[type, ...]) -> list[Any]:
        """The opener and every token up to its balancing closer, in page order, removed from the stack."""
        stack = self._tokens
        depth, index = 1, len(stack)
        while depth:
            index -= 1
            if index < 0:
                raise ParserError(f"{opens.__name__} without its closer")
            kind = type(stack[index])
            if kind is opens:
                depth += 1
            elif kind in closes:
                depth -= 1
        span = stack[index:]
        del stack[index:]
        span.reverse()
        return [opener, *span]


def parse_pruned(text: str, drop_tags: Collection[str]) -> Wikicode:
    """`mwparserfromhell.parse(text)`, with every template, heading and tag named in `drop_tags` (lower case) a
    `Dropped` node (module doc)."""
    parser = Parser()
    parser._builder = _PruningBuilder(drop_tags)  # the library's parse() with this builder in its place
    return parser.parse(text)
