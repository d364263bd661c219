"""Benchmark of data_prep on ../shared/data: pipeline tokens/s per core vs raw `tokenizers` batch-encode.

    python bench/data_prep_throughput.py [--data ../shared/data] [--workers N] [--parsers] [--no-wiki]

Prints, from one process: the whole pipeline's throughput (sources -> shards at 128 and 512),
the raw throughput of `tokenizers`' encode_batch on the very same cleaned sentences with the
same number of threads, their ratio (goal >= 0.5), bytes on disk per token, and with
`--parsers` the wikitext parser comparison (mwparserfromhell, used, vs wikitextparser).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WIKI_DUMP = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MARKUP = re.compile(r"\[\[|\]\]|\{\{|\}\}|<ref|''|==|\{\||\|\}")


def utf8_books(folder: Path, into: Path) -> Path:
    """Links to the books that are UTF-8 (one NLTK Gutenberg file is Latin-1, which we refuse)."""
    into.mkdir(parents=True, exist_ok=True)
    for book in sorted(folder.glob("*.txt")):
        try:
            book.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            print(f"skipping {book.name}: not UTF-8")
            continue
        (into / book.name).symlink_to(book)
    return into


def run_pipeline(data: Path, work: Path, workers: int, wiki: bool) -> tuple[float, dict]:
    from data_prep.build import run_build
    from data_prep.config import BuildConfig

    cfg = BuildConfig(
        out=str(work / "out"), wiki_dumps=(str(data / WIKI_DUMP),) if wiki else (),
        books=(str(utf8_books(data / "books" / "nltk_gutenberg", work / "books")),),
        vocab=str(data / "vocab" / "bert-base-uncased-vocab.txt"), seq_lens=(128, 512),
        num_shards=8, workers=workers, docs_per_chunk=16, keep_work=True,  # raw_tokenization reads work/text
    )
    started = time.perf_counter()
    manifest = run_build(cfg)
    return time.perf_counter() - started, manifest


def raw_tokenization(out: Path, vocab_path: Path, repeats: int = 3) -> tuple[float, int]:
    """Best-of-N seconds for encode_batch over every cleaned sentence the pipeline tokenized."""
    import pyarrow.ipc as ipc

    from data_prep.shard_format.vocab import load_vocab

    sentences = []
    for part in sorted((out / "work" / "text").glob("shard-*.arrow")):
        column = ipc.open_file(str(part)).read_all().column("sentences").to_pylist()
        sentences += [s for doc in column for s in doc]
    tokenizer = load_vocab(vocab_path).tokenizer()
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        encodings = tokenizer.encode_batch(sentences, add_special_tokens=False)
        best = min(best, time.perf_counter() - started)
        tokens = sum(len(e.ids) for e in encodings)
    return best, tokens


def compare_parsers(data: Path) -> None:
    from data_prep.clean import wikitext_to_paragraphs
    from data_prep.sources import read_wiki_dump

    docs = list(read_wiki_dump(data / WIKI_DUMP))
    chars = sum(len(d.text) for d in docs)
    started = time.perf_counter()
    ours = "\n".join("\n".join(wikitext_to_paragraphs(d.text)) for d in docs)
    ours_s = time.perf_counter() - started
    print(f"mwparserfromhell (used): {chars / ours_s / 1e6:.2f} MB/s of wikitext, "
          f"{len(MARKUP.findall(ours))} markup leftovers in {len(ours):,} chars of output")
    try:
        import wikitextparser
    except ImportError:
        print("wikitextparser: not installed (pip install wikitextparser) - comparison skipped")
        return
    started = time.perf_counter()
    theirs = "\n".join(wikitextparser.parse(d.text).plain_text() for d in docs)
    theirs_s = time.perf_counter() - started
    print(f"wikitextparser .plain_text(): {chars / theirs_s / 1e6:.2f} MB/s of wikitext, "
          f"{len(MARKUP.findall(theirs))} markup leftovers in {len(theirs):,} chars of output")
    print(f"speed ratio mwparserfromhell / wikitextparser: {theirs_s / ours_s:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--parsers", action="store_true", help="also compare wikitext parsers")
    parser.add_argument("--no-wiki", action="store_true", help="books only: the pipeline without wikitext parsing")
    args = parser.parse_args()
    # The raw baseline gets as many threads as the pipeline gets processes: a per-core comparison.
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    if not (args.data / WIKI_DUMP).is_file():
        sys.exit(f"{args.data}: no shared data (expected {WIKI_DUMP})")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        seconds, manifest = run_pipeline(args.data, work, args.workers, wiki=not args.no_wiki)
        tokens = manifest["totals"]["tokens"]
        raw_seconds, raw_tokens = raw_tokenization(work / "out", work / "out" / "vocab.txt")
        shard_bytes = {
            seq: sum((work / "out" / s["file"]).stat().st_size for split in entry.values() for s in split["shards"])
            for seq, entry in manifest["seq_lens"].items()
        }
    pipeline_rate = tokens / seconds / args.workers
    raw_rate = raw_tokens / raw_seconds / args.workers
    print(f"\ncorpus: {manifest['totals']['documents']} documents, {tokens:,} tokens; {args.workers} cores")
    print(f"pipeline (sources -> shards at 128 and 512): {seconds:.1f}s, {pipeline_rate:,.0f} tokens/s per core")
    print(f"raw tokenizers encode_batch, same sentences: {raw_seconds:.2f}s, {raw_rate:,.0f} tokens/s per core")
    print(f"ratio pipeline / raw tokenization: {pipeline_rate / raw_rate:.3f} (goal >= 0.5)")
    for seq, size in shard_bytes.items():
        print(f"bytes on disk per corpus token, seq {seq} shards: {size / tokens:.2f}")
    if args.parsers:
        compare_parsers(args.data)


if __name__ == "__main__":
    main()
