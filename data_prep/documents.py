"""One input document, and how it becomes sentences in a worker: within the caps on one document
(data_prep/config.py: DocumentLimits), or left out and counted.

Apart from the readers (data_prep/sources.py), which only split the input into documents.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from data_prep.clean import CostlyPage, wikitext_to_paragraphs
from data_prep.config import DEFAULT_LIMITS, DocumentLimits
from data_prep.sentences import split_sentences
from data_prep.source_files import DocumentTooLarge, SourceError
from data_prep.time_limit import TimeLimitExceeded, time_limit

# How a document's text is laid out, which decides how it becomes sentences.
WIKITEXT = "wikitext"  # MediaWiki markup
LINES = "lines"  # one sentence per line (BERT's sample_text.txt format)
PARAGRAPH_LINES = "paragraph_lines"  # one paragraph per line (WikiExtractor, HF wikipedia)
WRAPPED = "wrapped"  # hard-wrapped paragraphs separated by blank lines (Gutenberg books)
# A document over a cap of data_prep.config.DocumentLimits, left out under --skip-bad-files: it keeps its place
# (so the chunks are cut as they would be) and is counted by the worker (`documents_skipped`), no text.
SKIPPED = "skipped"


@dataclass(frozen=True)
class RawDocument:
    source: str
    title: str
    text: str
    layout: str


def to_sentences(doc: RawDocument, limits: DocumentLimits = DEFAULT_LIMITS) -> list[str]:
    if doc.layout == WIKITEXT:
        paragraphs = wikitext_to_paragraphs(doc.text, limits)
    elif doc.layout == LINES:
        return [line.strip() for line in doc.text.split("\n") if line.strip()]
    elif doc.layout == PARAGRAPH_LINES:
        paragraphs = [line.strip() for line in doc.text.split("\n") if line.strip()]
    elif doc.layout == WRAPPED:
        paragraphs = [" ".join(block.split()) for block in re.split(r"\n\s*\n", doc.text)]
    else:
        raise ValueError(f"unknown layout {doc.layout!r}")
    return [sentence for paragraph in paragraphs for sentence in split_sentences(paragraph)]


def document_sentences(doc: RawDocument, skip_bad_files: bool, limits: DocumentLimits = DEFAULT_LIMITS
                       ) -> list[str] | None:
    """`to_sentences` within the caps on one document, in the worker; None: the document is left out (a reader
    marked it SKIPPED, or its wikitext would cost the parser superlinear time, or its cleaning ran out of time).
    Without --skip-bad-files such a document stops the build, one line naming its file and title."""
    if doc.layout == SKIPPED:
        return None
    try:
        with time_limit(limits.parse_seconds):
            return to_sentences(doc, limits)
    except CostlyPage as err:
        reason = str(err)
    except TimeLimitExceeded:
        reason = (f"not cleaned within {limits.parse_seconds:g} s (the last-resort time limit: which documents it "
                  "stops depends on the machine's speed)")
    skip_or_raise(DocumentTooLarge(f"{doc.source}: {doc.title!r}: {reason}"), skip_bad_files)
    return None


def skipped(source: str, title: str, err: SourceError, skip_bad_files: bool) -> RawDocument:
    """The placeholder of a document over a cap (with a warning), or the error without --skip-bad-files."""
    skip_or_raise(err, skip_bad_files)
    return RawDocument(source, title, "", SKIPPED)


def skip_or_raise(err: SourceError, skip_bad_files: bool) -> None:
    """Raise `err`, or under --skip-bad-files print it as a warning (one line) and go on."""
    if not skip_bad_files:
        raise err
    print(f"warning: skipped (--skip-bad-files): {err}", file=sys.stderr, flush=True)
