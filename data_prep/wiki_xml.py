"""The pages of a MediaWiki XML dump, streamed in bounded memory whatever the dump holds.

expat is fed 1 MiB at a time and its handlers keep only the four fields a page needs, so nothing of a page
outlives it: `iterparse` built a tree whose finished pages, even cleared, stayed attached to the root (about
88 bytes a page, 2 GB over English Wikipedia). A page's text is kept up to a cap and then only counted, so a
decompression bomb inside one <text> costs no memory either. expat buffers text (`buffer_text`), so a page
costs a few handler calls, not one per line and entity. expat itself refuses entity expansion bombs
(billion laughs) with a parse error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO
from xml.parsers import expat

FEED_BYTES = 1 << 20
XMLError = expat.ExpatError  # what a malformed dump raises


@dataclass
class Page:
    """One <page>: its title, namespace, whether it is a redirect, and its first revision's text (`text_chars`
    counts all of it; past the cap the text is not kept and `oversized` is set)."""

    title: str = ""
    ns: str = "0"
    redirect: bool = False
    text: str = ""
    text_chars: int = 0
    oversized: bool = False
    parts: dict[str, list[str]] = field(default_factory=dict)


class _PageHandlers:
    """expat's handlers: a page's fields are collected by their place below <page>, as `page.findtext(...)`
    read them (an element's text before its first child; the first revision's text)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.done: list[Page] = []
        self._page: Page | None = None
        self._below: list[str] = []  # tags between the page and the current element
        self._fields: dict[tuple[str, ...], str] = {}
        self._redirect = ""
        self._collecting: list[str] | None = None  # the field whose text is being read
        self._is_text = False

    def start(self, name: str, _attributes: dict[str, str]) -> None:
        self._collecting = None  # text after a child element is not the parent's `.text`
        tag = "{" + name if "}" in name else name  # ElementTree's spelling, "{uri}local"
        page = self._page
        if page is None:
            if tag == "page" or tag.endswith("}page"):
                prefix = tag[: -len("page")]
                self._page, self._below, self._redirect = Page(), [], prefix + "redirect"
                self._fields = {(prefix + "title",): "title", (prefix + "ns",): "ns",
                                (prefix + "revision", prefix + "text"): "text"}
            return
        self._below.append(tag)
        if len(self._below) > 2:
            return
        if tag == self._redirect and len(self._below) == 1:
            page.redirect = True
        name_of = self._fields.get(tuple(self._below))
        if name_of is not None and name_of not in page.parts:
            self._collecting = page.parts[name_of] = []
            self._is_text = name_of == "text"

    def data(self, text: str) -> None:
        if self._collecting is None:
            return
        if self._is_text:
            page = self._page
            assert page is not None
            page.text_chars += len(text)
            if page.text_chars > self.cap:
                page.oversized = True
                self._collecting.clear()
                return
        self._collecting.append(text)

    def end(self, _name: str) -> None:
        self._collecting = None
        if self._page is None:
            return
        if self._below:
            self._below.pop()
            return
        page, self._page = self._page, None
        page.title = "".join(page.parts.get("title", ()))
        page.ns = "".join(page.parts.get("ns", ())) or "0"
        page.text = "".join(page.parts.get("text", ()))
        page.parts = {}
        self.done.append(page)


def dump_pages(handle: BinaryIO, max_text_chars: int) -> Iterator[Page]:
    """Every <page> of a dump in order; raises XMLError on malformed XML."""
    handlers = _PageHandlers(max_text_chars)
    parser = expat.ParserCreate(namespace_separator="}")
    parser.buffer_text = True
    parser.buffer_size = FEED_BYTES
    parser.StartElementHandler = handlers.start
    parser.EndElementHandler = handlers.end
    parser.CharacterDataHandler = handlers.data
    while chunk := handle.read(FEED_BYTES):
        parser.Parse(chunk, False)
        yield from handlers.done
        handlers.done.clear()
    parser.Parse(b"", True)
    yield from handlers.done
