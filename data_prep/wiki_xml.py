"""The pages of a MediaWiki XML dump, streamed in bounded memory whatever the dump holds.

expat (through ElementTree's parser) is fed 1 MiB at a time and calls a target that keeps only the four
fields a page needs, so nothing of a page outlives it: `iterparse` built a tree whose finished pages, even
cleared, stayed attached to the root (about 88 bytes a page, 2 GB over English Wikipedia). A page's text is
kept up to a cap and then only counted, so a decompression bomb inside one <text> costs no memory either.
expat itself refuses entity expansion bombs (billion laughs) with a parse error.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

FEED_BYTES = 1 << 20


@dataclass
class Page:
    """One <page>: its title, namespace, whether it is a redirect, and its first revision's text (`text_chars`
    counts all of it; past `cap` characters the text is not kept and `oversized` is set)."""

    title: str = ""
    ns: str = "0"
    redirect: bool = False
    text: str = ""
    text_chars: int = 0
    oversized: bool = False
    _parts: dict[str, list[str]] = field(default_factory=dict)


class _PageTarget:
    """The parser's target: fields are collected by their path below <page>, as `page.findtext(...)` read them
    (an element's text before its first child; the first revision's text)."""

    FIELDS = {("title",): "title", ("ns",): "ns", ("revision", "text"): "text"}

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.done: list[Page] = []
        self._page: Page | None = None
        self._namespace = ""
        self._path: list[str] = []  # tags below the current page
        self._collecting: list[str] | None = None  # the field whose text is being read

    def start(self, tag: str, _attrib: dict[str, str]) -> None:
        self._collecting = None  # text after a child element is not the parent's `.text`
        if self._page is None:
            if tag == "page" or tag.endswith("}page"):
                self._page, self._namespace, self._path = Page(), tag[: -len("page")], []
            return
        self._path.append(tag)
        local = tuple(t[len(self._namespace):] if t.startswith(self._namespace) else "\0" for t in self._path)
        if local == ("redirect",):
            self._page.redirect = True
        name = self.FIELDS.get(local)
        if name is not None and name not in self._page._parts:
            self._collecting = self._page._parts[name] = []

    def data(self, text: str) -> None:
        if self._collecting is None or self._page is None:
            return
        if self._collecting is self._page._parts.get("text"):
            self._page.text_chars += len(text)
            if self._page.text_chars > self.cap:
                self._page.oversized = True
                self._collecting.clear()
                return
        self._collecting.append(text)

    def end(self, _tag: str) -> None:
        self._collecting = None
        if self._page is None:
            return
        if self._path:
            self._path.pop()
            return
        page, self._page = self._page, None
        parts = page._parts
        page.title = "".join(parts.get("title", ())) or ""
        page.ns = "".join(parts.get("ns", ())) or "0"
        page.text = "".join(parts.get("text", ())) or ""
        page._parts = {}
        self.done.append(page)

    def close(self) -> None:
        return None


def dump_pages(handle: BinaryIO, max_text_chars: int) -> Iterator[Page]:
    """Every <page> of a dump in order; raises ET.ParseError on malformed XML."""
    target = _PageTarget(max_text_chars)
    parser = ET.XMLParser(target=target)
    while chunk := handle.read(FEED_BYTES):
        parser.feed(chunk)
        yield from target.done
        target.done.clear()
    parser.close()
    yield from target.done
