"""Where the shuffle runs: what each machine of a 2-node build writes and spends, the nodes against the merge.

    python bench/data_prep_shuffle_io.py [--size 1] [--workers 1] [--input-shard-mb 1] [--bucket N] [--before REF]

Builds the sample dump and books of ../shared/data (`--size` copies) as a user runs a 2-node build: both nodes
started together (`build --num-nodes 2 --node-rank r`), then `merge`, each a child process. For each of the three
it prints the wall and CPU seconds and the bytes its process tree wrote (getrusage of the child as os.wait4 reaps
it: ru_oublock, the bytes it dirtied in the page cache of a disk-backed file system; not on tmpfs), and for each
kind of file (work/instances, work/buckets, the shards) the bytes there once the nodes are done and once the merge
is. `--bucket N` records shuffle buckets of N instances for every train split before the build starts (as the
tests do), so that a corpus this small takes the bucketed path that a corpus over 2^24 instances of a length
takes: the keyed order's record (data_prep/keyed_order.py: instance files grouped by bucket, then the gathers),
which code before it reads as the scatter order's (scatter + gathers), so the manifests then differ.
`--before REF` runs the same build first with the data_prep package of commit REF
(`git archive` into a temp folder; nothing in the checkout changes), on the same machine in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.data_prep_memory import export_code, shared_inputs  # noqa: E402

KINDS = {"instances": "work/instances", "buckets": "work/buckets", "shards": "seq*"}
MB = 1e6


def folder_bytes(out: Path) -> dict[str, int]:
    sizes = {}
    for kind, pattern in KINDS.items():
        folders = list(out.glob(pattern))
        sizes[kind] = sum(p.stat().st_size for f in folders for p in f.rglob("*.arrow") if p.is_file())
    return sizes


def reap(process: subprocess.Popen, started: float) -> dict[str, float]:
    """Wall, CPU seconds and bytes written of one child's tree, from its own rusage."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{process.args}: exit {process.returncode}")
    return {"wall_s": time.perf_counter() - started, "cpu_s": usage.ru_utime + usage.ru_stime,
            "written_mb": usage.ru_oublock * 512 / MB}


def build(code: Path, inputs: list[str], out: Path, args: argparse.Namespace) -> dict[str, object]:
    # Run from `code` (python -m puts the working folder first on the path), one tokenizers thread per process.
    env = {**os.environ, "PYTHONPATH": str(code), "RAYON_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "data_prep", "build", *inputs, "--out", str(out), "--seq-lens", "128,512",
            "--num-shards", "8", "--input-shard-mb", str(args.input_shard_mb), "--workers", str(args.workers)]
    subprocess.run([*base, "--slurm", "--print-sbatch"], cwd=code, env=env, check=True, capture_output=True)  # claim + plan
    if args.bucket:
        for seq_len in (128, 512):
            record = out / "work" / "shards" / f"seq{seq_len}-train-order.json"
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"order": "keyed", "bucket_instances": args.bucket}), encoding="utf-8")
    waits = "--node-wait" in subprocess.run([*base[:4], "--help"], cwd=code, env=env, capture_output=True, text=True).stdout
    started = time.perf_counter()
    nodes = [subprocess.Popen([*base, "--num-nodes", "2", "--node-rank", str(rank)], cwd=code, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for rank in (0, 1)]
    roles = {f"node {rank}": reap(node, started) for rank, node in enumerate(nodes)}
    after_nodes = folder_bytes(out)
    started = time.perf_counter()
    merge = subprocess.Popen([sys.executable, "-m", "data_prep", "merge", "--out", str(out), "--workers",
                              str(args.workers), "--keep-work"], cwd=code, env=env, stdout=subprocess.DEVNULL)
    roles["merge"] = reap(merge, started)
    return {"roles": roles, "after_nodes": after_nodes, "after_merge": folder_bytes(out), "node_stages": waits,
            "manifest": (out / "manifest.json").read_bytes()}


def show(name: str, result: dict) -> None:
    print(f"\n{name}: nodes run instances and shards: {result['node_stages']}")
    print(f"{'process':8} {'wall s':>7} {'CPU s':>7} {'written MB':>11}")
    for role, row in result["roles"].items():
        print(f"{role:8} {row['wall_s']:7.1f} {row['cpu_s']:7.1f} {row['written_mb']:11.1f}")
    print(f"{'files MB':10} " + " ".join(f"{kind:>10}" for kind in KINDS))
    for when in ("after_nodes", "after_merge"):
        print(f"{when:10} " + " ".join(f"{result[when][kind] / MB:10.1f}" for kind in KINDS))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1, help="copies of the sample corpus")
    parser.add_argument("--workers", type=int, default=1, help="--workers of each node and of the merge")
    parser.add_argument("--input-shard-mb", type=float, default=1.0)
    parser.add_argument("--bucket", type=int, default=0, help="shuffle buckets of N instances (0: production)")
    parser.add_argument("--before", metavar="REF", help="also run the data_prep of git commit REF, first")
    args = parser.parse_args(argv)
    data = REPO.parent / "shared" / "data"
    if not data.is_dir():
        raise SystemExit(f"{data}: not there (the sample corpus this bench builds)")
    inputs = shared_inputs(data, args.size)
    with tempfile.TemporaryDirectory() as tmp:  # on a disk-backed file system for ru_oublock to count (not tmpfs)
        work = Path(tmp)
        results = {}
        if args.before:
            results[f"before ({args.before})"] = build(export_code(args.before, work / "before"), inputs,
                                                       work / "out-before", args)
        results["this code"] = build(REPO, inputs, work / "out", args)
        for name, result in results.items():
            show(name, result)
        if len(results) == 2:
            same = len({r["manifest"] for r in results.values()}) == 1
            print(f"\nmanifests byte-identical: {same}")


if __name__ == "__main__":
    main()
