"""Benchmark of data_prep on hostile input: growth ratios of cleaning and peak memory of reading.

    python bench/data_prep_hostile.py [--scale 1]

Prints, per vandalised pattern, the seconds at N and 4N and their ratio (about 4 is linear, 16 quadratic),
or that the page is refused before parsing; then, each in a fresh process, the peak RSS growth of reading
one 128 MiB JSON line, a .txt.bz2 that decompresses to 512 MiB, and the RSS per page of a dump of 200,000
small pages (at page 20,000 and 200,000). Files are written to a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import bz2
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 1 << 20
READ_PROBE = """
import resource, sys
from pathlib import Path
import data_prep.sources as S
def rss_mib(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def current_mib(): return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) / 1024
kind, path = sys.argv[1], Path(sys.argv[2])
base = rss_mib()
if kind == 'jsonl':
    list(S.read_jsonl_file(path, path.parent, True))
elif kind == 'book':
    list(S.read_book_file(path, path.parent, True))
else:
    for number, _ in enumerate(S.read_wiki_dump(path), 1):
        if number == 20_000: first = current_mib()
        if number == 200_000: last = current_mib()
    print(f'{(last - first) * (1 << 20) / 180_000:.0f} bytes per page (RSS at page 20,000 and 200,000)')
    sys.exit()
print(f'peak RSS growth {rss_mib() - base:.0f} MiB')
"""


def seconds(work: Callable[[], object]) -> float:
    """The best of three runs (the machine is shared)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def cleaning(scale: int) -> None:
    from data_prep.clean import CostlyPage, wikitext_to_paragraphs
    from data_prep.sentences import split_sentences
    from data_prep.wikitext_scan import strip_refs_and_comments

    cases = [
        ("strip <ref>x (unclosed)", strip_refs_and_comments, "<ref>x ", 8000),
        ("strip <!-- (unclosed)", strip_refs_and_comments, "<!-- x ", 8000),
        ("sentences: Mr. A", split_sentences, "Mr. A ", 4000),
        ("sentences: run of dots", split_sentences, ".", 10000),
        ("clean: {{a|x (unclosed)", wikitext_to_paragraphs, "{{a|x ", 4000),
        ("clean: <ref>x (unclosed)", wikitext_to_paragraphs, "<ref>x ", 8000),
        ("clean: ''x (linear, slow)", wikitext_to_paragraphs, "''x ", 2000),
    ]
    print(f"{'pattern':28} {'N':>7} {'s at N':>8} {'s at 4N':>8} {'ratio':>6}")
    for name, work, unit, count in cases:
        count *= scale
        try:
            small = seconds(lambda w=work, text=unit * count: w(text))
            large = seconds(lambda w=work, text=unit * count * 4: w(text))
            print(f"{name:28} {count:7} {small:8.3f} {large:8.3f} {large / max(small, 1e-9):6.1f}")
        except CostlyPage as err:
            print(f"{name:28} {count:7} refused before parsing: {str(err)[:60]}")


def reading(folder: Path) -> None:
    jsonl = folder / "big.jsonl"
    with open(jsonl, "wb") as handle:
        handle.write(b'{"text": "')
        for _ in range(128):
            handle.write(b"word " * (MIB // 5))
        handle.write(b'"}\n')
    book = folder / "bomb.txt.bz2"
    book.write_bytes(bz2.compress(b"a" * MIB) * 512)
    dump = folder / "many.xml"
    with open(dump, "wb") as handle:
        handle.write(b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">\n')
        for index in range(200_000):
            handle.write(f"<page><title>P{index}</title><ns>0</ns><revision><text>Page {index}."
                         "</text></revision></page>\n".encode())
        handle.write(b"</mediawiki>\n")
    for kind, path, what in (("jsonl", jsonl, "one 128 MiB JSON line"), ("book", book, "a 24 KiB .txt.bz2 of 512 MiB"),
                             ("dump", dump, "a dump of 200,000 pages")):
        result = subprocess.run([sys.executable, "-c", READ_PROBE, kind, str(path)], cwd=REPO, capture_output=True,
                                text=True, check=True)
        print(f"{what:32} {result.stdout.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=1, help="multiply the pattern counts")
    args = parser.parse_args()
    cleaning(args.scale)
    with tempfile.TemporaryDirectory() as folder:
        reading(Path(folder))


if __name__ == "__main__":
    main()
