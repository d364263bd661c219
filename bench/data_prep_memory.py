"""Memory of data prep as the corpus grows: peak RSS per stage and per process, and bytes per token.

    python bench/data_prep_memory.py [--corpus shared|books|synthetic] [--sizes 1,4,16] [--docs 400]
                                     [--docs-per-chunk N] [--workers 2] [--input-shard-mb M] [--single-node]
                                     [--before HEAD]

Builds one corpus repeated 1x, 4x and 16x (`shared`, the default when ../shared/data is there: its
sample dump and books, 1.5 M tokens per 1x; `books`: the UTF-8 sample books, each passed as a `--text` file,
0.8 M tokens per 1x; `synthetic`: the segment-mode tests' own corpus writer, `--docs` documents of ~330 tokens
per 1x), `--num-shards` 8 per 1x, at the build's default chunking (256 input documents; `--docs-per-chunk N`
sets another) and with input shards of `--input-shard-mb` (4, or 1 for `books`), so that the number of input
shards, not their size, grows with the corpus, as on a real one. Each build is two node builds
(`build --num-nodes 2 --node-rank r`, one after the other with `--node-wait 0`: vocab, corpus tasks, and for the
second node its share of the instance tasks) and a `merge` (the other instance tasks, shards), or with
`--single-node` one `build` as a user runs it on one machine, each a child process whose tree (main process
and spawned workers) is sampled every 20 ms from /proc/PID/status: RssAnon (the process's own memory:
what the fixes target), RssFile (mapped file pages: the token and instance files, shared page cache)
and VmRSS (their sum). It prints each stage's peak per process kind and for the whole tree, the tree's peak
over the whole build, then the slopes between sizes in bytes per corpus token (goal: at most 0.5 for the
tree's peak between the two largest sizes).

`--before REF` runs the same builds first with the data_prep package of git commit REF (exported with
`git archive` into a temp folder, nothing in the checkout changes), so the two are compared in one run
on the same loaded machine: read the ratios, not absolute figures. Peaks shorter than 20 ms are missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WIKI_DUMP = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# `stage X:` lines: this code prints vocab, corpus (its clean + tokenize tasks), instances, shards; a code
# before whole corpus tasks (--before) clean, vocab, tokenize (shown as corpus), instances, shards.
STAGE_AFTER = {"clean": "vocab", "vocab": "corpus", "corpus": "instances", "tokenize": "instances",
               "instances": "shards"}
NODE_LAST = ("corpus", "tokenize")  # a node build's last stage line
FIELDS = ("RssAnon", "RssFile", "VmRSS")
WHOLE_BUILD = "all"  # every sample of a size's builds: the peak a user's machine must hold
STAGES = ("clean", "vocab", "corpus", "instances", "shards", WHOLE_BUILD)
WHO = ("main", "worker", "tree")
MIB = 1 << 20


@dataclass
class Peaks:
    """Per stage: the peak (bytes) of each field for the main process, the largest worker, the tree."""

    by_stage: dict[str, dict[str, int]] = field(default_factory=dict)

    def record(self, stage: str, main: dict[str, int], workers: list[dict[str, int]]) -> None:
        for name in FIELDS:
            values = {
                f"main {name}": main.get(name, 0),
                f"worker {name}": max((w.get(name, 0) for w in workers), default=0),
                f"tree {name}": main.get(name, 0) + sum(w.get(name, 0) for w in workers),
            }
            for window in (stage, WHOLE_BUILD):
                peak = self.by_stage.setdefault(window, {})
                for key, value in values.items():
                    peak[key] = max(peak.get(key, 0), value)


def children(pid: int) -> list[int]:
    """Direct children of every thread of `pid` (a pool's workers are children of one of its threads)."""
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as handle:
                found += [int(c) for c in handle.read().split()]
    except OSError:
        pass
    return found


def status(pid: int) -> dict[str, int]:
    """RssAnon, RssFile and VmRSS of one process in bytes; empty when it has just exited."""
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return values


def sample_tree(root: int) -> tuple[dict[str, int], list[dict[str, int]]]:
    """The main process's figures and each descendant's (the spawn pool's resource tracker included)."""
    todo, descendants = children(root), []
    while todo:
        pid = todo.pop()
        descendants.append(pid)
        todo += children(pid)
    return status(root), [s for s in (status(p) for p in descendants) if s]


def run_watched(command: list[str], code: Path, first_stage: str, peaks: Peaks,
                last_stage: tuple[str, ...] = ("shards",)) -> None:
    """Run one command with the data_prep package in `code`; sample its tree into `peaks` until it exits.
    Stage names come from its `stage X:` lines, printed as a stage ends: the samples after one belong
    to the next stage, up to `last_stage` (a node build's samples after its tokenize stage, while it exits,
    stay in `tokenize`: they are not the merge's instance stage)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.Popen(command, cwd=code, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stage, log = [first_stage], []

    def read_output() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line.rstrip())
            if line.startswith("stage "):
                done = line.split(":")[0].split()[1]
                if done not in last_stage:
                    stage[0] = STAGE_AFTER.get(done, stage[0])

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    while proc.poll() is None:
        main, workers = sample_tree(proc.pid)
        if main:
            peaks.record(stage[0], main, workers)
        time.sleep(0.02)
    reader.join()
    if proc.returncode != 0:
        raise SystemExit(f"build failed ({proc.returncode}): {' '.join(command)}\n" + "\n".join(log[-20:]))


def synthetic_inputs(work: Path, docs: int, size: int) -> list[str]:
    """The test corpus of `docs` documents repeated `size` times in one --text file, and its vocab."""
    from tests.data_prep.segment_inputs import write_corpus, write_vocab

    base = work / f"synthetic-{docs}.txt"
    if not base.is_file():
        write_corpus(base, documents=docs)
        write_vocab(work / "synthetic-vocab.txt")
    corpus = work / f"synthetic-{docs}-x{size}.txt"
    # The base text ends in "\n", so the copies stay separate documents.
    corpus.write_text(base.read_text(encoding="utf-8") * size, encoding="utf-8")
    return ["--text", str(corpus), "--vocab", str(work / "synthetic-vocab.txt")]


def shared_inputs(data: Path, size: int) -> list[str]:
    """The sample dump and books, each passed `size` times (the Latin-1 book skipped with a warning)."""
    sources = ["--wiki-dump", str(data / WIKI_DUMP), "--books", str(data / "books" / "nltk_gutenberg")] * size
    return [*sources, "--skip-bad-files", "--vocab", str(data / "vocab" / "bert-base-uncased-vocab.txt")]


def book_inputs(data: Path, work: Path, size: int) -> list[str]:
    """The UTF-8 sample books, each a `--text` file (a paragraph per document), passed `size` times."""
    books = []
    for book in sorted((data / "books" / "nltk_gutenberg").glob("*.txt")):
        try:
            book.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        books += ["--text", str(book)]
    return [*books * size, "--vocab", str(data / "vocab" / "bert-base-uncased-vocab.txt")]


def export_code(ref: str, into: Path) -> Path:
    """data_prep as committed at `ref`, in a folder of its own (read-only git commands)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref, "data_prep"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


@dataclass
class Run:
    code: str
    size: int
    tokens: int
    peaks: Peaks


def build_once(code: Path, inputs: list[str], out: Path, args: argparse.Namespace,
               size: int) -> tuple[Peaks, int]:
    """One build of the corpus at `size` with the data_prep package found in `code`: two "nodes"
    (clean, vocab, tokenize), then `merge` in a fresh process tree (instances, shards), so that the
    merge's peaks are its own, not what tokenizing left in the main process."""
    build = [sys.executable, "-m", "data_prep", "build", *inputs, "--seq-lens", args.seq_lens,
             "--num-shards", str(8 * size), "--workers", str(args.workers), "--seed", "12345", "--out", str(out)]
    if args.docs_per_chunk is not None:
        build += ["--docs-per-chunk", str(args.docs_per_chunk)]
    if code == REPO:  # input shards exist in this code only (`--before` runs an older data_prep)
        build += ["--input-shard-mb", str(args.input_shard_mb)]
    peaks = Peaks()
    if args.single_node:
        run_watched(build, code, "clean", peaks)
        totals = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["totals"]
        return peaks, int(totals["tokens"])
    # The nodes run one after the other here: a node does not wait for the other's tasks (this code only).
    no_wait = ["--node-wait", "0"] if code == REPO else []
    for rank in (0, 1):
        run_watched([*build, "--num-nodes", "2", "--node-rank", str(rank), *no_wait], code, "clean", peaks,
                    last_stage=NODE_LAST)
    merge = [sys.executable, "-m", "data_prep", "merge", "--out", str(out), "--workers", str(args.workers)]
    run_watched(merge, code, "instances", peaks)
    totals = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["totals"]
    return peaks, int(totals["tokens"])


def slope(runs: list[Run], stage: str, key: str) -> float:
    """Bytes per corpus token: the least-squares slope of one peak over the sizes."""
    seen = [r for r in runs if stage in r.peaks.by_stage]
    xs = [r.tokens for r in seen]
    ys = [r.peaks.by_stage[stage].get(key, 0) for r in seen]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)  # a stage too short to be sampled in a run is left out
    if not var:
        return float("nan")
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var


def report(code: str, runs: list[Run]) -> dict[str, dict[str, float]]:
    """Print the peaks (MiB) per stage and size, then the slopes; returns the slopes."""
    print(f"\n== {code}: peak MiB per stage (main / largest worker / tree), RssAnon | RssFile")
    stages = [s for s in STAGES if s in runs[-1].peaks.by_stage]
    for run in runs:
        print(f"  {run.size:>3}x  {run.tokens:>11,} tokens")
        for stage in stages:
            if stage not in run.peaks.by_stage:
                continue
            peak = run.peaks.by_stage[stage]
            anon = " / ".join(f"{peak.get(f'{who} RssAnon', 0) / MIB:7.1f}" for who in WHO)
            mapped = " / ".join(f"{peak.get(f'{who} RssFile', 0) / MIB:6.1f}" for who in WHO)
            print(f"       {stage:<10} {anon}  |  {mapped}")
    slopes: dict[str, dict[str, float]] = {}
    print(f"-- {code}: slope, bytes per corpus token: least squares over the sizes (between the two largest)")
    for stage in stages:
        keys = list(runs[-1].peaks.by_stage[stage])
        slopes[stage] = {key: slope(runs, stage, key) for key in keys}
        slopes[stage].update({f"{key} last": slope(runs[-2:], stage, key) for key in keys})
        s = slopes[stage]
        print(f"  {stage:<10} " + "  ".join(
            f"{name} {who} {s[f'{who} {name}']:5.2f} ({s[f'{who} {name} last']:5.2f})"
            for name in ("RssAnon", "VmRSS") for who in WHO))
    return slopes


def measure(code_name: str, code: Path, args: argparse.Namespace, work: Path) -> dict[str, dict[str, float]]:
    runs = []
    for size in args.sizes:
        if args.corpus == "synthetic":
            inputs = synthetic_inputs(work, args.docs, size)
        elif args.corpus == "books":
            inputs = book_inputs(args.data, work, size)
        else:
            inputs = shared_inputs(args.data, size)
        out = work / f"{code_name}-x{size}"
        started = time.perf_counter()
        peaks, tokens = build_once(code, inputs, out, args, size)
        print(f"{code_name} {size}x: {tokens:,} tokens in {time.perf_counter() - started:.0f}s", flush=True)
        runs.append(Run(code_name, size, tokens, peaks))
    return report(code_name, runs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=("synthetic", "shared", "books"),
                        help="default: shared when --data holds the sample dump, else synthetic")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--docs-per-chunk", type=int,
                        help="input documents per chunk (default: the build's own, 256)")
    parser.add_argument("--single-node", action="store_true", help="one build instead of two nodes and a merge")
    parser.add_argument("--docs", type=int, default=400, help="synthetic documents at 1x")
    parser.add_argument("--sizes", default="1,4,16", help="corpus repeats, comma-separated")
    parser.add_argument("--seq-lens", default="128,512")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--input-shard-mb", type=float,
                        help="input shard size (default 4: ~2 input shards per 1x of the shared corpus; 1 for books), "
                             "so that shards, not their size, grow with the corpus, as on a real one")
    parser.add_argument("--before", metavar="REF", help="also run data_prep as committed at REF (e.g. HEAD)")
    parser.add_argument("--json", type=Path, help="write the slopes here")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.corpus is None:
        args.corpus = "shared" if (args.data / WIKI_DUMP).is_file() else "synthetic"
    if args.input_shard_mb is None:
        args.input_shard_mb = 1.0 if args.corpus == "books" else 4.0
    if args.corpus != "synthetic" and not (args.data / WIKI_DUMP).is_file():
        parser.error(f"--corpus shared: {args.data / WIKI_DUMP} not found (pass --data)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="dp_memory_") as tmp:
        work = Path(tmp)
        if args.before:
            old_code = export_code(args.before, work / "old")
            results["before"] = measure(f"before ({args.before})", old_code, args, work)
        results["after"] = measure("after (working tree)", REPO, args, work)
    if args.before:
        print("\n== before -> after: RssAnon slope of main, of the largest worker, of the tree, bytes per "
              "token: least squares (between the two largest sizes)")
        for stage in ("instances", "shards"):
            old, new = results["before"][stage], results["after"][stage]
            print(f"  {stage:<10} " + "   ".join(
                f"{who} {old[f'{who} RssAnon']:5.2f} -> {new[f'{who} RssAnon']:5.2f} "
                f"({old[f'{who} RssAnon last']:5.2f} -> {new[f'{who} RssAnon last']:5.2f})" for who in WHO))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
