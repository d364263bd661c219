"""Linear scans over wikitext: removing <ref>s and comments, unwrapping leftover links, and counting the
openers a page never closes.

The regexes these replace (`<ref\\b[^>]*>.*?</ref\\s*>`, `\\[\\[(?:[^|\\]]*\\|)?([^\\]]*)\\]\\]`, ...) rescan the
rest of the text for every opener they cannot close, so a page of unclosed `<ref>`s took quadratic time
(8,000 of them, 55 KiB: 3.4 s). Here every search for a closer is remembered: the first closer at or after a
position is found once, and the openers after it reuse it, so each character is looked at a bounded number
of times. The results are exactly the regexes' (tests/data_prep/test_linear_prep.py compares them on random
markup).
"""

from __future__ import annotations

import re
from collections.abc import Callable

_Found = tuple[int, int] | None  # (start, end) of a match, or None: no match at or after the position


class _FirstFrom:
    """The first match at or after a position, for positions that never go back: a search that found
    nothing is never repeated, and one that found a match is reused until the position passes it."""

    def __init__(self, find: Callable[[int], _Found]) -> None:
        self._find = find
        self._found: _Found = None
        self._exhausted = False

    def at_or_after(self, position: int) -> _Found:
        if self._exhausted:
            return None
        if self._found is None or self._found[0] < position:
            self._found = self._find(position)
            self._exhausted = self._found is None
        return self._found


def _literal(text: str, needle: str) -> _FirstFrom:
    def find(position: int) -> _Found:
        at = text.find(needle, position)
        return None if at < 0 else (at, at + len(needle))
    return _FirstFrom(find)


def _pattern(text: str, pattern: re.Pattern[str]) -> _FirstFrom:
    def find(position: int) -> _Found:
        match = pattern.search(text, position)
        return None if match is None else match.span()
    return _FirstFrom(find)


_REF_OR_COMMENT = re.compile(r"<ref\b|<!--", re.IGNORECASE)
_REF_CLOSE = re.compile(r"</ref\s*>", re.IGNORECASE)
_LEFTOVER_REF_OPEN = re.compile(r"<ref", re.IGNORECASE)
_LEFTOVER_REF_CLOSE = re.compile(r"</ref>", re.IGNORECASE)


def _ref_end(text: str, start: int, tag_end: _FirstFrom, close: _FirstFrom, to_end: bool) -> int | None:
    """Where the <ref> opened at `start` ends: after `/>` when its first `>` closes it, else after its closer;
    with no closer, at the end of the text when `to_end`, else None (left in place)."""
    gt = tag_end.at_or_after(start + 4)  # "<ref" is 4 characters; its attributes hold no '>'
    if gt is None:
        return None
    if gt[0] >= start + 5 and text[gt[0] - 1] == "/":
        return gt[1]
    closer = close.at_or_after(gt[1])
    if closer is not None:
        return closer[1]
    return len(text) if to_end else None


def strip_refs_and_comments(text: str) -> str:
    """`re.sub(r"<ref\\b[^>]*/>|<ref\\b[^>]*>.*?</ref\\s*>|<!--.*?-->", "", text, flags=IGNORECASE | DOTALL)`
    in linear time: an unclosed <ref> or comment stays in place, as with the regex."""
    tag_end, close, comment_end = _literal(text, ">"), _pattern(text, _REF_CLOSE), _literal(text, "-->")
    kept: list[str] = []
    emitted = search = 0
    while (opener := _REF_OR_COMMENT.search(text, search)) is not None:
        start = opener.start()
        if opener.group().startswith("<!"):
            found = comment_end.at_or_after(start + 4)
            end = None if found is None else found[1]
        else:
            end = _ref_end(text, start, tag_end, close, to_end=False)
        if end is None:
            search = start + 1
            continue
        kept.append(text[emitted:start])
        emitted = search = end
    kept.append(text[emitted:])
    return "".join(kept)


def strip_leftover_refs(line: str) -> str:
    """`re.sub(r"<ref[^>]*?/>|<ref[^>]*>.*?(</ref>|$)", "", line, flags=IGNORECASE)` on one line (no newline)
    in linear time: a <ref> the parser left as text goes to its closer or to the end of the line."""
    tag_end, close = _literal(line, ">"), _pattern(line, _LEFTOVER_REF_CLOSE)
    kept: list[str] = []
    emitted = 0
    while (opener := _LEFTOVER_REF_OPEN.search(line, emitted)) is not None:
        start = opener.start()
        end = _ref_end(line, start, tag_end, close, to_end=True)
        if end is None:  # no '>' after this opener, so none after any later one either
            break
        kept.append(line[emitted:start])
        emitted = end
    kept.append(line[emitted:])
    return "".join(kept)


def unwrap_leftover_links(line: str) -> str:
    """`re.sub(r"\\[\\[(?:[^|\\]]*\\|)?([^\\]]*)\\]\\]", r"\\1", line)` in linear time: `[[target|text]]` and
    `[[text]]` the parser left as text become their text."""
    bracket, bar = _literal(line, "]"), _literal(line, "|")
    kept: list[str] = []
    emitted = search = 0
    while (start := line.find("[[", search)) >= 0:
        close = bracket.at_or_after(start + 2)  # the link's text holds no ']': it ends at the first one
        if close is None:
            break
        if line[close[1] : close[1] + 1] != "]":
            search = start + 1
            continue
        pipe = bar.at_or_after(start + 2)
        text_start = pipe[1] if pipe is not None and pipe[0] < close[0] else start + 2
        kept.append(line[emitted:start])
        kept.append(line[text_start : close[0]])
        emitted = search = close[1] + 1
    kept.append(line[emitted:])
    return "".join(kept)


# Tags mwparserfromhell never expects a closer for (its `is_single`): they cost it no rescan.
_SINGLE_TAGS = frozenset({"br", "wbr", "hr", "meta", "link", "img", "li", "dt", "dd", "th", "td", "tr"})
_TAG = re.compile(r"<(/?)([A-Za-z][\w-]*)([^<>]*)")
_BRACKETS = (("{{", "}}"), ("[[", "]]"), ("{|", "|}"), ("[", "]"))


# An opening tag whose '>' never comes costs the parser about four times an unclosed template (measured: 1,000
# `<ref x ` in 7 KiB, 2.6 s; 2,000 `{{a|x ` in 12 KiB, 3.4 s): counted that many times.
_UNTERMINATED_TAG_WEIGHT = 4


def unclosed_openers(text: str) -> int:
    """Openers of templates, links, tables, external links and tags beyond their closers, counted in one pass
    per kind: what makes the parser rescan the rest of the page once each. 0 on a balanced page."""
    count = sum(max(0, text.count(opener) - text.count(closer)) for opener, closer in _BRACKETS)
    balance: dict[str, int] = {}
    for tag in _TAG.finditer(text):
        name = tag.group(2).lower()
        terminated = text.startswith(">", tag.end())
        if not terminated:
            count += _UNTERMINATED_TAG_WEIGHT
        if name in _SINGLE_TAGS:
            continue
        if tag.group(1):
            balance[name] = balance.get(name, 0) - 1
        elif not (tag.group(3).endswith("/") and terminated):
            balance[name] = balance.get(name, 0) + 1
    return count + sum(max(0, opened) for opened in balance.values())
