"""Benchmark of data_prep on ../shared/data: tokens per CPU-second per stage and end to end, against raw
`tokenizers` encode_batch, and the wall-time scaling from 1 to W workers.

    python bench/data_prep_throughput.py [--data ../shared/data] [--workers W] [--input-shard-mb 1]
                                         [--no-wiki] [--parsers] [--before REF]

One run, one process tree at a time: the sample dump and the UTF-8 sample books are built (seq 128 and 512) with
`--workers 1` and then `--workers W`, each `python -m data_prep build` a child process with one `tokenizers`
thread per process (RAYON_NUM_THREADS=1). `--input-shard-mb` (1 by default) cuts the sample into several input
shards, so that W corpus tasks can run at once (at the default 256 the whole sample is one input shard).

Printed, all measured in this run:
  * per stage of the one-worker build: CPU seconds and corpus tokens per CPU-second (the corpus stage's clean and
    tokenize parts as its tasks report them, the later stages from the build's own CPU clock at each stage line);
  * end to end: corpus tokens per CPU-second of the whole build (every process of its tree), and its ratio to raw
    `tokenizers` encode_batch on the very same cleaned sentences, one thread, best of 3 (goal >= 0.5);
  * bytes on disk per corpus token of the shards at each length and of the work/ files (kept here);
  * scaling: wall seconds at 1 and W workers, the speed-up and its ratio to W (goal >= 0.8), and the main
    process's share of the W-worker build's CPU (the serial part: speed-up <= 1 / (share + (1 - share) / W)).
    Wall times are only meaningful on an otherwise idle machine; CPU figures hold on a shared one.
`--parsers` adds the wikitext parser comparison (mwparserfromhell, used, vs wikitextparser). `--before REF` also
builds at one worker with the data_prep of git commit REF (first, in the same run) and prints its per-stage
table beside this code's, with whether both made the same shards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.data_prep_memory import export_code  # noqa: E402  (data_prep of another commit, for --before)

WIKI_DUMP = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MARKUP = re.compile(r"\[\[|\]\]|\{\{|\}\}|<ref|''|==|\{\||\|\}")
# The child: the build with each stdout line stamped with the main process's CPU seconds (all its threads), and
# at exit the CPU of the main process and of its waited-for children (the pool's workers).
CHILD = """
import resource, sys, time
class Stamped:
    def __init__(self, out): self.out = out
    def write(self, text):
        for line in text.splitlines(True):
            self.out.write(f"[cpu {time.process_time():.3f}] {line}" if line.startswith("stage ") else line)
    def flush(self): self.out.flush()
sys.stdout = Stamped(sys.stdout)
from data_prep.__main__ import main
code = main(sys.argv[1:])
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"[rusage] main {me.ru_utime + me.ru_stime:.3f} children {kids.ru_utime + kids.ru_stime:.3f}", flush=True)
sys.exit(code)
"""
STAGE = re.compile(r"^\[cpu (?P<cpu>[\d.]+)\] stage (?P<name>[^:]+): (?P<wall>[\d.]+)s(?P<rest>.*)$")
TASK_CPU = re.compile(r"task CPU: clean (?P<clean>[\d.]+)s, tokenize (?P<tokenize>[\d.]+)s")
RUSAGE = re.compile(r"^\[rusage\] main (?P<main>[\d.]+) children (?P<children>[\d.]+)$")


def utf8_books(folder: Path, into: Path) -> Path:
    """Links to the books that are UTF-8 (one NLTK Gutenberg file is Latin-1, which we refuse)."""
    if into.is_dir():
        return into
    into.mkdir(parents=True)
    for book in sorted(folder.glob("*.txt")):
        try:
            book.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        (into / book.name).symlink_to(book)
    return into


def build(args: argparse.Namespace, work: Path, workers: int, code: Path = REPO, name: str = "") -> dict:
    """One build in a child process, with the data_prep of `code` (the rest of the repository from here):
    wall seconds, CPU (main, children), per-stage CPU, corpus tokens."""
    out = work / f"out{name}-w{workers}"
    sources = ["--books", str(utf8_books(args.data / "books" / "nltk_gutenberg", work / "books"))]
    if not args.no_wiki:
        sources = ["--wiki-dump", str(args.data / WIKI_DUMP), *sources]
    argv = ["build", *sources, "--vocab", str(args.data / "vocab" / "bert-base-uncased-vocab.txt"),
            "--seq-lens", "128,512", "--num-shards", "8", "--input-shard-mb", str(args.input_shard_mb),
            "--workers", str(workers), "--out", str(out), "--keep-work"]  # raw_tokenization reads work/text
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{REPO}", "RAYON_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=code, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    stages, last_cpu = {}, 0.0
    for line in done.stdout.splitlines():
        if (stage := STAGE.match(line)) is not None:
            cpu = float(stage["cpu"])
            stages[stage["name"]] = {"wall": float(stage["wall"]), "main_cpu": cpu - last_cpu}
            if (parts := TASK_CPU.search(stage["rest"])) is not None:
                stages[stage["name"]].update(clean=float(parts["clean"]), tokenize=float(parts["tokenize"]))
            last_cpu = cpu
        elif (usage := RUSAGE.match(line)) is not None:
            main_cpu, children_cpu = float(usage["main"]), float(usage["children"])
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    return {"out": out, "wall": wall, "main_cpu": main_cpu, "cpu": main_cpu + children_cpu, "stages": stages,
            "tokens": manifest["totals"]["tokens"], "input_shards": len(list((out / "work" / "text").glob("*.arrow"))),
            "digests": [s["sha256"] for entry in manifest["seq_lens"].values() for split in entry.values()
                        for s in split["shards"]],
            "shard_bytes": {seq: sum((out / s["file"]).stat().st_size for split in entry.values() for s in split["shards"])
                            for seq, entry in manifest["seq_lens"].items()},
            "work_bytes": {folder.name: sum(p.stat().st_size for p in folder.rglob("*.arrow"))
                           for folder in sorted((out / "work").iterdir()) if folder.is_dir()}}


def raw_tokenization(out: Path, repeats: int = 3) -> dict[str, tuple[float, int]]:
    """Best-of-N CPU seconds of one-thread encode_batch (the goal's yardstick) and encode_batch_fast (the same
    ids, no offsets) over every cleaned sentence the pipeline tokenized, and the tokens they made."""
    import pyarrow.ipc as ipc
    from tokenizers import Tokenizer

    from data_prep.shard_format.vocab import load_vocab

    sentences = []
    for part in sorted((out / "work" / "text").glob("shard-*.arrow")):
        column = ipc.open_file(str(part)).read_all().column("sentences").to_pylist()
        sentences += [s for doc in column for s in doc]
    tokenizer = Tokenizer.from_str(load_vocab(out / "vocab.txt").tokenizer().to_str())
    results = {}
    for method in ("encode_batch", "encode_batch_fast"):
        best, tokens = float("inf"), 0
        for _ in range(repeats):
            started = time.process_time()
            encodings = getattr(tokenizer, method)(sentences, add_special_tokens=False)
            best = min(best, time.process_time() - started)
            tokens = sum(len(e.ids) for e in encodings)
        results[method] = (best, tokens)
    return results


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


def stage_cpu(run: dict) -> dict[str, float]:
    """CPU seconds per stage of a one-worker build: the corpus tasks' clean and tokenize parts, the later
    stages from the main process's clock at each stage line, and the rest (start-up, plan, vocab, manifest)."""
    corpus = run["stages"].get("corpus", {})
    parts = {"clean": corpus.get("clean", 0.0), "tokenize": corpus.get("tokenize", 0.0)}
    parts.update({name: stage["main_cpu"] for name, stage in run["stages"].items() if name != "corpus"})
    parts["other (start-up, plan, vocab, manifest)"] = run["cpu"] - sum(parts.values())
    return parts


def report(one: dict, many: dict, workers: int, raw: dict[str, tuple[float, int]], before: dict | None) -> None:
    tokens = one["tokens"]
    print(f"\ncorpus: {tokens:,} tokens, {one['input_shards']} input shards; builds at 1 and {workers} workers give "
          f"{'the same' if one['digests'] == many['digests'] else 'DIFFERENT'} shards")
    runs = {"this code": one} if before is None else {f"before ({before['ref']})": before, "this code": one}
    if before is not None:
        print(f"before and this code give {'the same' if before['digests'] == one['digests'] else 'DIFFERENT'} "
              "shards")
    print("per stage, 1 worker: CPU seconds, corpus tokens per CPU-second" + ("" if before is None else
          " (" + " | ".join(runs) + ")"))
    tables = {name: stage_cpu(run) for name, run in runs.items()}
    for stage in tables["this code"]:
        cells = []
        for table in tables.values():
            cpu = table.get(stage, 0.0)
            cells.append(f"{cpu:7.2f} s {tokens / cpu if cpu > 0 else float('nan'):>11,.0f} tokens/CPU-s")
        print(f"  {stage:<40} " + " | ".join(cells))
    raw_cpu, raw_tokens = raw["encode_batch"]
    raw_rate = raw_tokens / raw_cpu
    fast_cpu, _ = raw["encode_batch_fast"]
    print(f"raw one-thread tokenizers on the same sentences: encode_batch {raw_cpu:.2f} CPU-s ({raw_rate:,.0f} "
          f"tokens/CPU-s), encode_batch_fast (no offsets; what the build calls) {fast_cpu:.2f} CPU-s")
    for name, run in runs.items():
        rate = tokens / run["cpu"]
        print(f"end to end, 1 worker, {name}: {run['cpu']:.2f} CPU-s, {rate:,.0f} tokens/CPU-s; ratio to raw "
              f"encode_batch {rate / raw_rate:.3f} (goal >= 0.5)")
    many_rate = tokens / many["cpu"]
    print(f"end to end, {workers} workers: {many['cpu']:.2f} CPU-s, {many_rate:,.0f} tokens/CPU-s; ratio "
          f"{many_rate / raw_rate:.3f}")
    speedup = one["wall"] / many["wall"]
    share = many["main_cpu"] / many["cpu"]
    bound = 1 / (share + (1 - share) / workers)
    print(f"scaling: wall {one['wall']:.1f} s at 1 worker, {many['wall']:.1f} s at {workers}: speed-up {speedup:.2f}, "
          f"{speedup / workers:.2f} x W (goal >= 0.8); main process {100 * share:.1f} % of the CPU at {workers} "
          f"workers (speed-up bound {bound:.2f}, {bound / workers:.2f} x W)")
    for name, stage in many["stages"].items():
        print(f"  {name:<24} wall {one['stages'].get(name, {}).get('wall', float('nan')):6.1f} s -> "
              f"{stage['wall']:6.1f} s")
    corpus_many = many["stages"].get("corpus", {})
    if "clean" in corpus_many:
        print(f"corpus stage at {workers} workers: the main process used {corpus_many['main_cpu']:.2f} CPU-s beside "
              f"the tasks' {corpus_many['clean'] + corpus_many['tokenize']:.2f}")
    print("bytes on disk per corpus token: " + ", ".join(
        [f"seq {seq} shards {size / tokens:.2f}" for seq, size in one["shard_bytes"].items()]
        + [f"work/{name} {size / tokens:.2f}" for name, size in one["work_bytes"].items() if size]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--input-shard-mb", type=float, default=1.0)
    parser.add_argument("--parsers", action="store_true", help="also compare wikitext parsers")
    parser.add_argument("--no-wiki", action="store_true", help="books only: the pipeline without wikitext parsing")
    parser.add_argument("--before", metavar="REF", help="also build at one worker with the data_prep of commit REF")
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"  # the raw baseline: one thread, before tokenizers starts its pool
    if not (args.data / WIKI_DUMP).is_file():
        sys.exit(f"{args.data}: no shared data (expected {WIKI_DUMP})")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        before = None
        if args.before:
            before = {**build(args, work, 1, export_code(args.before, work / "before"), "-before"), "ref": args.before}
        one = build(args, work, 1)
        many = build(args, work, args.workers)
        report(one, many, args.workers, raw_tokenization(one["out"]), before)
    print(f"(bench process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB peak)")
    if args.parsers:
        compare_parsers(args.data)


if __name__ == "__main__":
    main()
