"""Readers, one per source kind. Each yields RawDocument in a fixed order, in constant memory.

Readers only split the input into documents; turning a document into sentences (wikitext
cleaning, paragraph joining, sentence splitting) is `to_sentences`, which runs in the workers.
"""

from __future__ import annotations

import bz2
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from data_prep.clean import is_disambiguation, is_redirect, wikitext_to_paragraphs
from data_prep.sentences import split_sentences

# How a document's text is laid out, which decides how it becomes sentences.
WIKITEXT = "wikitext"  # MediaWiki markup
LINES = "lines"  # one sentence per line (BERT's sample_text.txt format)
PARAGRAPH_LINES = "paragraph_lines"  # one paragraph per line (WikiExtractor, HF wikipedia)
WRAPPED = "wrapped"  # hard-wrapped paragraphs separated by blank lines (Gutenberg books)


class SourceError(ValueError):
    """An input file or folder is missing, unreadable, corrupt or not UTF-8; names the path."""


@dataclass(frozen=True)
class RawDocument:
    source: str
    title: str
    text: str
    layout: str


def to_sentences(doc: RawDocument) -> list[str]:
    if doc.layout == WIKITEXT:
        paragraphs = wikitext_to_paragraphs(doc.text)
    elif doc.layout == LINES:
        return [line.strip() for line in doc.text.split("\n") if line.strip()]
    elif doc.layout == PARAGRAPH_LINES:
        paragraphs = [line.strip() for line in doc.text.split("\n") if line.strip()]
    elif doc.layout == WRAPPED:
        paragraphs = [" ".join(block.split()) for block in re.split(r"\n\s*\n", doc.text)]
    else:
        raise ValueError(f"unknown layout {doc.layout!r}")
    return [sentence for paragraph in paragraphs for sentence in split_sentences(paragraph)]


# ---------------------------------------------------------------- file checks, run before work starts


def _open_binary(path: Path):
    return bz2.open(path, "rb") if path.suffix == ".bz2" else open(path, "rb")


def check_readable_file(path: Path, flag: str) -> None:
    """Exists, readable, decompresses (bz2), and its first MiB decodes as UTF-8."""
    if not path.is_file():
        raise SourceError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise SourceError(f"{flag} {path}: not readable (permissions)")
    try:
        with _open_binary(path) as handle:
            head = handle.read(1 << 20)
    except (OSError, EOFError) as err:
        raise SourceError(f"{flag} {path}: corrupt or unreadable ({err})") from err
    try:
        # A multi-byte character may be cut at the end of the sample: tolerate only that.
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 4:
            raise SourceError(f"{flag} {path}: not UTF-8 (byte offset {err.start})") from err


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SourceError(f"{path}: not UTF-8 (byte offset {err.start})") from err


def _read_text(path: Path) -> str:
    try:
        with _open_binary(path) as handle:
            data = handle.read()
    except (OSError, EOFError) as err:
        raise SourceError(f"{path}: corrupt or unreadable ({err})") from err
    return _decode(path, data)


def list_text_files(folder: Path, flag: str) -> list[Path]:
    if not folder.is_dir():
        raise SourceError(f"{flag} {folder}: no such folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    if flag != "--wikiextractor":  # WikiExtractor names its files wiki_00 ...; books are *.txt[.bz2]
        files = [p for p in files if p.name.endswith((".txt", ".txt.bz2"))]
    if not files:
        raise SourceError(f"{flag} {folder}: no text files in it")
    return files


# ---------------------------------------------------------------- Wikipedia XML dump


def read_wiki_dump(path: Path) -> Iterator[RawDocument]:
    """Main-namespace articles of a pages-articles dump; redirects and disambiguation pages dropped.

    Streams with iterparse and clears every <page> after use, so memory stays flat on a 20 GB
    dump. bz2.open reads multistream files (concatenated streams) transparently.
    """
    source = f"wiki:{path.name}"
    try:
        with _open_binary(path) as handle:
            for _event, element in ET.iterparse(handle, events=("end",)):
                if not element.tag.endswith("}page") and element.tag != "page":
                    continue
                namespace = element.tag[: -len("page")]
                title = element.findtext(f"{namespace}title") or ""
                ns = element.findtext(f"{namespace}ns") or "0"
                text = element.findtext(f"{namespace}revision/{namespace}text") or ""
                redirect = element.find(f"{namespace}redirect") is not None
                element.clear()
                if ns != "0" or redirect or is_redirect(text) or is_disambiguation(title, text):
                    continue
                yield RawDocument(source, title, text, WIKITEXT)
    except ET.ParseError as err:
        raise SourceError(f"--wiki-dump {path}: malformed XML ({err})") from err
    except (OSError, EOFError) as err:
        raise SourceError(f"--wiki-dump {path}: corrupt or unreadable ({err})") from err
    except UnicodeDecodeError as err:
        raise SourceError(f"--wiki-dump {path}: not UTF-8 ({err})") from err


# ---------------------------------------------------------------- WikiExtractor output

_DOC_OPEN = re.compile(r'<doc id="([^"]*)"[^>]*title="([^"]*)"[^>]*>')


def read_wikiextractor(folder: Path, skip_bad_files: bool = False) -> Iterator[RawDocument]:
    """`<doc id= url= title=>` ... `</doc>` files (plain or .bz2); the repeated title line is skipped."""
    for path in list_text_files(folder, "--wikiextractor"):
        source = f"wikiextractor:{path.relative_to(folder)}"
        title: str | None = None
        lines: list[str] = []
        try:
            text = _read_text(path)
        except SourceError as err:
            _skip_or_raise(SourceError(f"--wikiextractor {err}"), skip_bad_files)
            continue
        for line in text.split("\n"):
            opened = _DOC_OPEN.match(line)
            if opened:
                title, lines = opened.group(2), []
            elif line.startswith("</doc>") and title is not None:
                body = lines[1:] if lines and lines[0].strip() == title.strip() else lines
                yield RawDocument(source, title, "\n".join(body), PARAGRAPH_LINES)
                title = None
            elif title is not None:
                lines.append(line)


# ---------------------------------------------------------------- books and plain text

_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)


def strip_gutenberg(text: str) -> str:
    """Drop the Project Gutenberg licence header and footer when the markers are present."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def _skip_or_raise(err: SourceError, skip_bad_files: bool) -> None:
    if not skip_bad_files:
        raise err
    print(f"warning: skipped (--skip-bad-files): {err}", file=sys.stderr, flush=True)


def read_books(folder: Path, skip_bad_files: bool = False) -> Iterator[RawDocument]:
    """One book per file; hard-wrapped or one-sentence-per-line paragraphs both work."""
    for path in list_text_files(folder, "--books"):
        try:
            raw = _read_text(path)
        except SourceError as err:
            _skip_or_raise(SourceError(f"--books {err}"), skip_bad_files)
            continue
        text = strip_gutenberg(raw.replace("\r\n", "\n"))
        yield RawDocument(f"books:{path.relative_to(folder)}", path.stem, text, WRAPPED)


def read_sentence_lines(path: Path) -> Iterator[RawDocument]:
    """One sentence per line, blank lines between documents (BERT's input format), streamed."""
    source = f"text:{path.name}"
    lines: list[str] = []
    count = 0
    try:
        with _open_binary(path) as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError as err:
                    raise SourceError(f"--text {path}: not UTF-8 (line {number})") from err
                if line:
                    lines.append(line)
                elif lines:
                    count += 1
                    yield RawDocument(source, f"{path.name}#{count}", "\n".join(lines), LINES)
                    lines = []
    except (OSError, EOFError) as err:
        raise SourceError(f"--text {path}: corrupt or unreadable ({err})") from err
    if lines:
        yield RawDocument(source, f"{path.name}#{count + 1}", "\n".join(lines), LINES)


# ---------------------------------------------------------------- Hugging Face datasets


def read_hf_dataset(spec: str, text_field: str = "text", rows_per_doc: int = 1) -> Iterator[RawDocument]:
    """`NAME[:CONFIG]` through `datasets` (streaming from the Hub), or a `save_to_disk` folder.

    Each row is a document, or `rows_per_doc` consecutive rows are one (bookcorpus stores one
    sentence per row and no book boundaries).
    """
    import datasets  # imported here: it is slow to import and only this source needs it

    name, _, config = spec.partition(":")
    saved = Path(name)
    if saved.is_dir() and ((saved / "dataset_dict.json").is_file() or (saved / "state.json").is_file()):
        loaded = datasets.load_from_disk(name)
        dataset = loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
    else:
        try:
            dataset = datasets.load_dataset(name, config or None, split="train", streaming=True)
        except Exception as err:  # datasets raises many types (hub, file, config errors)
            raise SourceError(f"--hf-dataset {spec}: cannot load ({type(err).__name__}: {err})") from err
    source = f"hf:{spec}"
    layout = PARAGRAPH_LINES  # a row is a paragraph (wikipedia, wikitext) or a sentence (bookcorpus)
    buffer: list[str] = []
    first_title = ""
    for index, row in enumerate(dataset):
        if text_field not in row:
            raise SourceError(f"--hf-dataset {spec}: rows have no {text_field!r} field (fields: {sorted(row)})")
        if not buffer:
            first_title = str(row.get("title") or f"{spec}#{index}")
        buffer.append(str(row[text_field]))
        if len(buffer) >= rows_per_doc:
            yield RawDocument(source, first_title, "\n".join(buffer), layout)
            buffer = []
    if buffer:
        yield RawDocument(source, first_title, "\n".join(buffer), layout)
