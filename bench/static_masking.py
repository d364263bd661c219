"""Static masking's two draw engines, measured against each other as ratios (data_prep/shard_format/masking.py).

    python bench/static_masking.py [--data ../shared/data] [--seq-len 128] [--dupe-factor 1] [--repeat 3]

Builds the sample books (the UTF-8 ones of nltk_gutenberg, with bert-base-uncased's vocab, one worker) three
ways: dynamic (no masking at build time), static with the default google draws, and static with
`--mask-draws numpy`. Prints each build's instance stage (the line the build prints, `stage instances: Ns`), the
masking's own share of it (static minus dynamic), and the ratio google / numpy of both. Then, on the instances of
the dynamic build, the two maskers alone, per instance, best of `--repeat`: `mask_instance` (random.Random) and
`mask_ids` (numpy), and their ratio. Ratios, not seconds, are what carries over between machines; run it on an
idle machine (the figures of a loaded one scatter).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.data_prep_throughput import utf8_books  # noqa: E402  (the UTF-8 sample books, linked)
from data_prep.__main__ import main as data_prep_main  # noqa: E402
from data_prep.shard_format.masking import mask_ids, mask_instance  # noqa: E402
from data_prep.shard_format.modes import max_predictions_for  # noqa: E402
from data_prep.shard_format.shards import Manifest, read_table  # noqa: E402
from data_prep.shard_format.vocab import load_vocab  # noqa: E402

STAGE = re.compile(r"stage instances: ([0-9.]+)s")
MODES = {"dynamic": [], "google": ["--masking", "static"], "numpy": ["--masking", "static", "--mask-draws", "numpy"]}


def build(books: Path, vocab: Path, out: Path, args: argparse.Namespace, mode: str) -> float:
    """One build; its instance stage's seconds, as the build printed them."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = data_prep_main(["build", "--books", str(books), "--vocab", str(vocab), "--out", str(out),
                                 "--seq-lens", str(args.seq_len), "--dupe-factor", str(args.dupe_factor),
                                 "--num-shards", "1", "--workers", "1", *MODES[mode]])
    found = STAGE.search(printed.getvalue())
    if status != 0 or not found:
        raise SystemExit(f"the {mode} build failed:\n{printed.getvalue()}")
    return float(found.group(1))


def maskers_alone(out: Path, args: argparse.Namespace) -> tuple[float, float, int]:
    """Seconds per instance of each engine (best of `repeat`) over the dynamic build's training instances."""
    manifest = Manifest.load(out)
    vocab = load_vocab(manifest.vocab_path)
    shard = manifest.data["seq_lens"][str(args.seq_len)]["train"]["shards"][0]["file"]
    rows = read_table(out / shard).column("input_ids").to_pylist()
    arrays = [np.asarray(ids, dtype=np.int64) for ids in rows]
    slots = max_predictions_for(args.seq_len)
    google = numpy = float("inf")
    for _ in range(args.repeat):
        rng, started = random.Random(1), time.perf_counter()
        for ids in rows:
            mask_instance(ids, 0.15, slots, vocab.special, vocab.size, rng)
        google = min(google, time.perf_counter() - started)
        generator, started = np.random.default_rng(1), time.perf_counter()
        for ids in arrays:
            mask_ids(ids, vocab, 0.15, slots, False, generator)
        numpy = min(numpy, time.perf_counter() - started)
    return google / len(rows), numpy / len(rows), len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dupe-factor", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    vocab = args.data / "vocab" / "bert-base-uncased-vocab.txt"
    with tempfile.TemporaryDirectory() as tmp:
        books = utf8_books(args.data / "books" / "nltk_gutenberg", Path(tmp) / "books")
        stage = {mode: build(books, vocab, Path(tmp) / mode, args, mode) for mode in MODES}
        google, numpy, count = maskers_alone(Path(tmp) / "dynamic", args)
    print(f"instance stage, one worker, seq {args.seq_len}, dupe factor {args.dupe_factor}: "
          + ", ".join(f"{mode} {seconds:.2f}s" for mode, seconds in stage.items()))
    cost = {mode: stage[mode] - stage["dynamic"] for mode in ("google", "numpy")}
    print(f"instance stage google / numpy: {stage['google'] / stage['numpy']:.2f}x; masking's own share "
          f"(static - dynamic): google {cost['google']:.2f}s, numpy {cost['numpy']:.2f}s"
          + (f", ratio {cost['google'] / cost['numpy']:.2f}x" if cost["numpy"] > 0 else ""))
    print(f"maskers alone over {count} instances: mask_instance (google) {google * 1e6:.1f} us, mask_ids (numpy) "
          f"{numpy * 1e6:.1f} us per instance: {google / numpy:.2f}x")


if __name__ == "__main__":
    main()
