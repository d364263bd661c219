"""Readers, one per source kind, and `SOURCES`, the one table of them.

Each reader yields RawDocument in a fixed order, in constant memory. Readers only split the input
into documents; turning a document into sentences (wikitext cleaning, paragraph joining, sentence
splitting) is `to_sentences`, which runs in the workers.

A new source is a reader and one `Source` row here: the `build` flags (data_prep/__main__.py), the
config and its identity (data_prep/config.py), the input checks, the description of the inputs
(data_prep/build.py) and the document order (data_prep/input_plan.py) all loop over `SOURCES`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_prep.byte_ranges import BLANK_LINE, LINE, LongLine, file_lines, range_name
from data_prep.bz2_streams import BZ2_STREAMS, open_stream_range
from data_prep.clean import is_disambiguation, is_redirect
from data_prep.config import DEFAULT_LIMITS, DocumentLimits

# RawDocument, the layouts and to_sentences are known from here too (tests, tools): re-exported
from data_prep.documents import (  # noqa: F401
    LINES,
    PARAGRAPH_LINES,
    SKIPPED,
    WIKITEXT,
    WRAPPED,
    RawDocument,
    skip_or_raise,
    skipped,
    to_sentences,
)
from data_prep.hf_source import read_hf_dataset
from data_prep.jsonl_source import JSONL_SUFFIXES, read_jsonl, read_jsonl_file
from data_prep.parquet_source import PARQUET_SUFFIXES, ROW_GROUPS, check_parquet_file, read_parquet_file
from data_prep.source_files import (
    DocumentTooLarge,
    SourceError,
    check_folder,
    check_readable_file,
    list_text_files,
    open_binary,
    read_text,
    with_compression,
)
from data_prep.wiki_xml import XMLError, dump_pages

# Wikipedia XML dump

def read_wiki_dump(path: Path, skip_bad_files: bool = False, limits: DocumentLimits = DEFAULT_LIMITS,
                   start: int = 0, end: int | None = None) -> Iterator[RawDocument]:
    """Main-namespace articles of a pages-articles dump; redirects and disambiguation pages dropped.

    Streamed page by page in bounded memory (data_prep/wiki_xml.py) on a 20 GB dump; .bz2 (multistream files,
    concatenated streams, too), .gz and .zst are decompressed as read; with a byte range (a multistream dump cut
    at stream starts, data_prep/bz2_streams.py), only the pages of the streams in it. A page over MediaWiki's own size limit is left
    out and counted under --skip-bad-files, else stops the build naming it.
    """
    source = f"wiki:{path.name}"
    try:
        with open_binary(path) if start == 0 and end is None else open_stream_range(path, start, end) as handle:
            for page in dump_pages(handle, limits.max_wikitext_chars):
                if page.ns != "0" or page.redirect:
                    continue
                if page.oversized:
                    yield skipped(source, page.title, DocumentTooLarge(
                        f"--wiki-dump {path}: page {page.title!r}: {page.text_chars:,} characters of wikitext, over "
                        f"the {limits.max_wikitext_chars:,} MediaWiki allows"), skip_bad_files)
                    continue
                if is_redirect(page.text) or is_disambiguation(page.title, page.text):
                    continue
                yield RawDocument(source, page.title, page.text, WIKITEXT)
    except XMLError as err:
        raise SourceError(f"--wiki-dump {path}: malformed XML ({err})") from err
    except (OSError, EOFError) as err:
        raise SourceError(f"--wiki-dump {path}: corrupt or unreadable ({err})") from err
    except UnicodeDecodeError as err:
        raise SourceError(f"--wiki-dump {path}: not UTF-8 ({err})") from err


# WikiExtractor output
_DOC_OPEN = re.compile(r'<doc id="([^"]*)"[^>]*title="([^"]*)"[^>]*>')


_DOC_HEADER_CHARS = 1 << 16  # a <doc ...> line is a few hundred characters; longer ones are text


def read_wikiextractor(folder: Path, skip_bad_files: bool = False,
                       limits: DocumentLimits = DEFAULT_LIMITS) -> Iterator[RawDocument]:
    """`<doc id= url= title=>` ... `</doc>` files (plain or compressed); the repeated title line is skipped."""
    for path in list_text_files(folder, "--wikiextractor", None):
        yield from read_wikiextractor_file(path, folder, skip_bad_files, limits)


def read_wikiextractor_file(path: Path, folder: Path, skip_bad_files: bool = False,
                            limits: DocumentLimits = DEFAULT_LIMITS) -> Iterator[RawDocument]:
    """The documents of one WikiExtractor file of `folder` (its name relative to the folder is the source). The
    file is read whole, up to `max_document_bytes` decompressed (WikiExtractor writes 1 MB files by default)."""
    source = f"wikiextractor:{path.relative_to(folder)}"
    title: str | None = None
    lines: list[str] = []
    try:
        text = read_text(path, limits.max_document_bytes)
    except DocumentTooLarge as err:
        yield skipped(source, path.name, DocumentTooLarge(f"--wikiextractor {err}"), skip_bad_files)
        return
    except SourceError as err:
        skip_or_raise(SourceError(f"--wikiextractor {err}"), skip_bad_files)
        return
    for line in text.split("\n"):
        # the regex backtracks over a line without a closing '>': only a header's length is tried
        opened = _DOC_OPEN.match(line) if len(line) <= _DOC_HEADER_CHARS else None
        if opened:
            title, lines = opened.group(2), []
        elif line.startswith("</doc>") and title is not None:
            body = lines[1:] if lines and lines[0].strip() == title.strip() else lines
            yield RawDocument(source, title, "\n".join(body), PARAGRAPH_LINES)
            title = None
        elif title is not None:
            lines.append(line)


# books and plain text
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


BOOK_SUFFIXES = with_compression((".txt",))  # .txt, .txt.bz2, .txt.gz, .txt.zst


def read_books(folder: Path, skip_bad_files: bool = False,
               limits: DocumentLimits = DEFAULT_LIMITS) -> Iterator[RawDocument]:
    """One book per file; hard-wrapped or one-sentence-per-line paragraphs both work."""
    for path in list_text_files(folder, "--books", BOOK_SUFFIXES):
        yield from read_book_file(path, folder, skip_bad_files, limits)


def read_book_file(path: Path, folder: Path, skip_bad_files: bool = False,
                   limits: DocumentLimits = DEFAULT_LIMITS) -> Iterator[RawDocument]:
    """One book, read up to `max_document_bytes` (decompressed: a small .bz2 can expand without bound)."""
    try:
        raw = read_text(path, limits.max_document_bytes)
    except DocumentTooLarge as err:
        yield skipped(f"books:{path.relative_to(folder)}", path.stem, DocumentTooLarge(f"--books {err}"),
                       skip_bad_files)
        return
    except SourceError as err:
        skip_or_raise(SourceError(f"--books {err}"), skip_bad_files)
        return
    text = strip_gutenberg(raw.replace("\r\n", "\n"))
    yield RawDocument(f"books:{path.relative_to(folder)}", path.stem, text, WRAPPED)


def read_sentence_lines(path: Path, start: int = 0, end: int | None = None, skip_bad_files: bool = False,
                        limits: DocumentLimits = DEFAULT_LIMITS) -> Iterator[RawDocument]:
    """One sentence per line, blank lines between documents (BERT's input format), streamed; with a byte range
    (data_prep/byte_ranges.py: cut at document starts), only the documents that start in it. A document over
    `max_document_bytes` (one line, or all of its lines) is skipped and counted, or stops the build."""
    source, name = f"text:{path.name}", range_name(path, start, end)
    lines: list[str] = []
    count = size = 0
    too_long: int | None = None  # the line at which the document went over the cap

    def finish() -> RawDocument:
        title = f"{name}#{count}"
        if too_long is None:
            return RawDocument(source, title, "\n".join(lines), LINES)
        return skipped(source, title, DocumentTooLarge(
            f"--text {path}: line {too_long}{'' if start == 0 else f' from byte {start}'}: document over "
            f"{limits.max_document_bytes:,} bytes"), skip_bad_files)

    try:
        for number, raw in enumerate(file_lines(path, start, end, limits.max_document_bytes), start=1):
            if isinstance(raw, LongLine):
                too_long, lines = too_long or number, []
                continue
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                raise SourceError(f"--text {path}: not UTF-8 (line {number} from byte {start})") from err
            if line:
                size += len(raw)
                if size > limits.max_document_bytes:
                    too_long, lines = too_long or number, []
                elif too_long is None:
                    lines.append(line)
            elif lines or too_long is not None:
                count += 1
                yield finish()
                lines, size, too_long = [], 0, None
    except (OSError, EOFError) as err:
        raise SourceError(f"--text {path}: corrupt or unreadable ({err})") from err
    if lines or too_long is not None:
        count += 1
        yield finish()


# the table of sources
FILE, FOLDER, NAME = "file", "folder", "name"  # what a source's value is: its check, and whether it is a path


@dataclass(frozen=True)
class Option:
    """A setting one source needs besides its values (which column holds the text): a flag of the
    inputs group and a part of the config's identity, checked before any work starts."""

    flag: str
    field: str  # config field and identity key
    default: Any
    help: str
    type: Callable[[str], Any] = str
    valid: Callable[[Any], bool] | None = None  # False: `FLAG VALUE: out of range`

    @property
    def dest(self) -> str:
        """The argparse attribute of `flag`."""
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class ReadContext:
    """What a reader may use besides one value: the --skip-bad-files choice and its row's options."""

    skip_bad_files: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    limits: DocumentLimits = DEFAULT_LIMITS


@dataclass(frozen=True)
class Source:
    """One kind of input. Its row decides the flag, the config field (which is the identity key: do not
    rename it, or folders built with it stop resuming), the check run before work and the reader."""

    flag: str  # repeatable flag of `build`
    field: str
    metavar: str
    help: str
    kind: str  # FILE, FOLDER (files ending in `suffixes`, sorted) or NAME (not a path: not checked)
    read: Callable[[str, ReadContext], Iterator[RawDocument]]  # one value -> its documents, in order
    # FOLDER: one of its files -> that file's documents, (file, folder, context); `read` is these in turn.
    read_file: Callable[[Path, Path, ReadContext], Iterator[RawDocument]] | None = None
    # Plain files larger than an input shard are cut at document starts (data_prep/byte_ranges.py) when
    # `cut_at` says what separates documents; `read_range(file, folder or file, context, start, end)` reads one.
    cut_at: str | None = None
    read_range: Callable[[Path, Path, ReadContext, int, int | None], Iterator[RawDocument]] | None = None
    suffixes: tuple[str, ...] | None = None  # FOLDER: the file names read; None: every file
    options: tuple[Option, ...] = ()
    skips_bad_files: bool = False  # honours --skip-bad-files
    check_file: Callable[[Path, str], None] = check_readable_file  # (file, flag): SourceError naming the file

    @property
    def dest(self) -> str:
        """The argparse attribute of `flag`."""
        return self.flag.lstrip("-").replace("-", "_")

    def recorded(self, values: tuple[str, ...]) -> tuple[str, ...]:
        """The values as the identity records them: paths absolute, so a resume from another folder matches."""
        return values if self.kind == NAME else tuple(str(Path(v).resolve()) for v in values)

    def check(self, value: str, skip_bad_files: bool) -> None:
        """Exists, readable, UTF-8 (the first MiB of each file), no file of a folder left out unnamed: before hours
        of work, one line naming the file."""
        if self.kind == FILE:
            self.check_file(Path(value), self.flag)
        elif self.kind == FOLDER:
            for path in check_folder(Path(value), self.flag, self.suffixes, skip_bad_files and self.skips_bad_files):
                try:
                    self.check_file(path, self.flag)
                except SourceError:
                    if not (skip_bad_files and self.skips_bad_files):
                        raise
                    # reported (and skipped) when the file is read


# Read in this order: a build's documents (and so its chunks and bytes) follow it. Append new rows
# where you like, but never reorder or rename the first five: their folders would no longer match.
SOURCES: tuple[Source, ...] = (
    Source("--wiki-dump", "wiki_dumps", "PATH",
           "Wikipedia pages-articles XML dump, .xml or .xml.bz2 (multistream too), .xml.gz, .xml.zst; repeatable",
           FILE, lambda value, context: read_wiki_dump(Path(value), context.skip_bad_files, context.limits),
           cut_at=BZ2_STREAMS, read_range=lambda path, _root, context, start, end: read_wiki_dump(
               path, context.skip_bad_files, context.limits, start, end)),
    Source("--wikiextractor", "wikiextractor", "DIR",
           "folder of WikiExtractor output (<doc id= url= title=> files); repeatable",
           FOLDER, lambda value, context: read_wikiextractor(Path(value), context.skip_bad_files, context.limits),
           read_file=lambda path, folder, context: read_wikiextractor_file(path, folder, context.skip_bad_files,
                                                                           context.limits),
           skips_bad_files=True),
    Source("--books", "books", "DIR",
           "folder of plain-text books, one per file (Gutenberg header/footer stripped); repeatable",
           FOLDER, lambda value, context: read_books(Path(value), context.skip_bad_files, context.limits),
           read_file=lambda path, folder, context: read_book_file(path, folder, context.skip_bad_files,
                                                                  context.limits),
           suffixes=BOOK_SUFFIXES, skips_bad_files=True),
    Source("--text", "texts", "FILE", "one sentence per line, blank line between documents (plain, .bz2, .gz or "
           ".zst); repeatable",
           FILE, lambda value, context: read_sentence_lines(Path(value), 0, None, context.skip_bad_files,
                                                            context.limits), cut_at=BLANK_LINE,
           read_range=lambda path, _root, context, start, end: read_sentence_lines(
               path, start, end, context.skip_bad_files, context.limits)),
    Source("--jsonl", "jsonl", "DIR",
           'folder of JSON-lines files (*.jsonl, *.json, each also .gz, .bz2, .zst; sorted): one {"text": ...} '
           "document per line, a paragraph per line of text; repeatable",
           FOLDER, lambda value, context: read_jsonl(Path(value), context.skip_bad_files, context.limits),
           read_file=lambda path, folder, context: read_jsonl_file(path, folder, context.skip_bad_files,
                                                                   limits=context.limits),
           cut_at=LINE, read_range=lambda path, folder, context, start, end: read_jsonl_file(
               path, folder, context.skip_bad_files, start, end, context.limits),
           suffixes=JSONL_SUFFIXES, skips_bad_files=True),
    Source("--hf-dataset", "hf_datasets", "NAME[:CONFIG]",
           "Hugging Face dataset by name (streamed, split 'train') or a save_to_disk folder; repeatable",
           NAME, lambda value, context: read_hf_dataset(
               value, context.options["hf_text_field"], context.options["hf_rows_per_doc"]),
           options=(
               Option("--hf-text-field", "hf_text_field", "text", "column holding the text in --hf-dataset"),
               Option("--hf-rows-per-doc", "hf_rows_per_doc", 1,
                      "consecutive rows forming one document (bookcorpus has one sentence per row)",
                      type=int, valid=lambda rows: rows >= 1),
           )),    Source("--parquet", "parquet", "DIR",
           "folder of parquet files (*.parquet, sorted; FineWeb style): one document per row of the "
           "--parquet-text-field column, a paragraph per line; large files are cut at row groups; repeatable",
           FOLDER, lambda value, context: (doc for path in list_text_files(Path(value), "--parquet", PARQUET_SUFFIXES)
                                           for doc in _parquet(path, Path(value), context)),
           read_file=lambda path, folder, context: _parquet(path, folder, context),
           cut_at=ROW_GROUPS, read_range=lambda path, folder, context, start, end: _parquet(
               path, folder, context, start, end),
           suffixes=PARQUET_SUFFIXES, skips_bad_files=True, check_file=check_parquet_file,
           options=(Option("--parquet-text-field", "parquet_text_field", "text", "column holding the text in --parquet"),)),
)


def _parquet(path: Path, folder: Path, context: ReadContext, start: int = 0, end: int | None = None
             ) -> Iterator[RawDocument]:
    return read_parquet_file(path, folder, context.options["parquet_text_field"], context.skip_bad_files, start,
                             end, context.limits)
