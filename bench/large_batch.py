"""Experiment: does LAMB keep the held-out MLM loss as the batch grows, where AdamW loses it?

    python bench/large_batch.py [--quick] [--results docs/large_batch.json] [--plot docs/large_batch.png]
                                [--shared-data ../shared/data] [--work runs/bench_large_batch]
                                [--parallel 2] [--ranks 1] [--base-batch 16] [--multipliers 1,4,16]
                                [--samples 16384] [--lamb-lr 1e-2] [--adamw-lr 1e-3] [--adamw-grid 0.5,1,2]

Phase-1-style pretraining (seq 64 as in the demo's phase 1, BERT masking, NSP, a linear warmup then
poly-0.5 decay) of a small BERT (2 layers, hidden 128) on the real sample corpus (the enwiki dump, the
WikiExtractor sample and the Gutenberg novels of ../shared/data, WordPiece 8192 trained on it): one run
of the real driver (`python -m pretrain.train`, a DeepSpeed engine, fp32) per (optimizer, batch, lr).
Every run sees the same samples in the same order from the same initial weights (same seed; the
micro-batch is the base batch B at every global batch, so batch kB is k consecutive micro-batches of
the same stream), and is scored on the same held-out micro-batches (the same masks) at the same
sample counts (every 1/8 of the run).

The paper's rules for its batch sweep (LAMB paper, Table 4: "square root LR scaling and linear-epoch
warmup"), applied to both optimizers:
  lr(kB)     = lr(B) * sqrt(k)
  warmup(kB) = warmup_fraction(B) * k of the steps, i.e. the same number of warmup steps at every batch
               (the paper: 1/320 of the steps at 512 ... 1/5 at 32K; here 1/160 at B ... 1/10 at 16B,
               as the paper's 1K ... 16K).
LAMB runs once per batch with that rule (lr(B) chosen once at B). AdamW runs at every point of
--adamw-grid times its rule lr, and its best final loss per batch is the one compared.

Results go to --results after every run (JSON, keyed by run): a rerun skips the runs it holds, so an
interrupted sweep resumes where it stopped; a results file made with other settings is refused. The
table and the plot are rebuilt from the file (bench/large_batch_report.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_batch_report import plot, ratio_lines, read_run, table, unigram_loss  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
CODE_PACKAGES = ("pretrain", "data_prep")  # what a run executes; frozen per sweep (see snapshot_code)


@dataclass(frozen=True)
class Settings:
    """Everything that defines the experiment; one results file holds runs of one Settings only (the grids
    excepted: they choose which runs are planned, not what a run is)."""

    seq_len: int = 64  # the demo's phase-1 length: more instances, and half the cost of 128 on 2 cores
    layers: int = 2  # the model: small enough for 18 runs in about half an hour on 2 shared cores
    hidden: int = 128
    heads: int = 2
    intermediate: int = 512
    vocab_size: int = 8192
    base_batch: int = 16  # B, and the micro-batch of every run (so every batch reads the same stream)
    multipliers: tuple[int, ...] = (1, 4, 16)
    samples: int = 16384  # per run, whatever the batch
    lamb_lr: float = 1e-2  # at B; the rule scales it
    adamw_lr: float = 1e-3  # at B; the grid multiplies the rule's lr
    adamw_grid: tuple[float, ...] = (0.5, 1.0, 2.0)
    # x1 is the rule, the LAMB that is compared; the other points show how much its result owes to
    # lr(B) having been picked once, from a 2-point pilot (they are reported beside it, not instead).
    lamb_grid: tuple[float, ...] = (0.5, 1.0, 2.0)
    warmup_fraction_base: float = 1 / 160  # at B; k times that at kB (the same warmup steps everywhere)
    # false: no trust ratio where weight decay is 0 (biases, LayerNorm), as NVIDIA's FusedLAMB and the
    # TF-Addons LAMB and the shipped configs do. true (Algorithm 2 as printed) makes a zero-initialised bias
    # grow only by a factor (1 + lr) per step, too slowly for the MLM decoder bias to learn the
    # unigram distribution in runs this short.
    lamb_adapt_all: bool = False
    weight_decay: float = 0.01
    gradient_clipping: float = 1.0
    val_points: int = 8  # held-out evaluations per run, at equal sample counts in every run
    val_batches: int = 32  # held-out micro-batches of B sequences per evaluation
    seed: int = 11
    books: bool = True  # the 7 Gutenberg novels beside the Wikipedia samples (--quick: Wikipedia alone)

    def check(self) -> None:
        """Refuse settings whose runs would not see equal samples at equal evaluation points."""
        top = self.base_batch * max(self.multipliers)
        if self.samples % (top * self.val_points):
            raise SystemExit(f"--samples {self.samples}: must be a multiple of the largest batch {top} x "
                             f"{self.val_points} evaluation points (= {top * self.val_points})")
        if self.warmup_fraction_base * max(self.multipliers) >= 1.0:
            raise SystemExit(f"--warmup-fraction-base {self.warmup_fraction_base}: x {max(self.multipliers)} "
                             "(the largest multiplier) must stay below 1")
        for name in ("lamb_lr", "adamw_lr"):
            if getattr(self, name) <= 0:
                raise SystemExit(f"--{name.replace('_', '-')} {getattr(self, name)}: must be > 0")
        if 1.0 not in self.lamb_grid:
            raise SystemExit(f"--lamb-grid {self.lamb_grid}: must contain 1 (the rule's lr)")
        if sorted(set(self.multipliers)) != list(self.multipliers) or self.multipliers[0] < 1:
            raise SystemExit(f"--multipliers {self.multipliers}: must be increasing integers >= 1")


QUICK = dict(layers=2, hidden=64, heads=2, intermediate=128, base_batch=8, multipliers=(1, 4),
             samples=512, adamw_grid=(0.5, 2.0), lamb_grid=(1.0,), val_points=2, val_batches=4,
             books=False)
# Which runs are planned, not what a run is: a results file stays valid when only these change.
GRID_FIELDS = ("adamw_grid", "lamb_grid")


@dataclass(frozen=True)
class RunSpec:
    optimizer: str
    multiplier: int
    lr_factor: float = 1.0  # the grid point; 1 is the rule's lr

    @property
    def key(self) -> str:
        return f"{self.optimizer}-k{self.multiplier}-x{self.lr_factor:g}"

    def batch(self, s: Settings) -> int:
        return s.base_batch * self.multiplier

    def steps(self, s: Settings) -> int:
        return s.samples // self.batch(s)

    def lr(self, s: Settings) -> float:
        base = s.lamb_lr if self.optimizer == "lamb" else s.adamw_lr
        return base * math.sqrt(self.multiplier) * self.lr_factor

    def warmup_fraction(self, s: Settings) -> float:
        return s.warmup_fraction_base * self.multiplier


def plan(s: Settings) -> list[RunSpec]:
    """The sweep, largest batches first (shortest runs: a broken setting shows in minutes)."""
    specs = []
    for k in sorted(s.multipliers, reverse=True):
        specs += [RunSpec("lamb", k, f) for f in sorted(s.lamb_grid, key=lambda f: f != 1.0)]
        specs += [RunSpec("adamw", k, f) for f in s.adamw_grid]
    return specs


def cpu_env(code: Path = REPO_ROOT) -> dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = "1"  # one thread per process: the runs share the machine
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH", "")]))
    return env


def snapshot_code(work: Path) -> tuple[Path, str]:
    """Copy the driver's packages into WORK/code and hash them: every run of a sweep executes that copy.

    A sweep takes half an hour in a tree others edit; runs that started before and after an edit of
    the trainer would not be comparable. The hash is stored with every run, and the report says when a
    results file mixes runs of different code (a resumed sweep after an edit).
    """
    dest = work / "code"
    if dest.exists():
        shutil.rmtree(dest)
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT)
            data = path.read_bytes()
            digest.update(rel.as_posix().encode() + b"\0" + data)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
    return dest, digest.hexdigest()[:16]


def build_shards(shared: Path, out: Path, s: Settings) -> Path:
    """Shards from the real sample corpus (cached in `out`: data_prep reports a finished folder as done)."""
    if (out / "manifest.json").is_file():
        return out
    dump = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    sources = {"--wiki-dump": shared / "wikipedia" / dump,
               "--wikiextractor": shared / "wikipedia" / "wikiextractor_sample",
               **({"--books": shared / "books" / "nltk_gutenberg"} if s.books else {})}
    for path in sources.values():
        if not path.exists():
            raise SystemExit(f"--shared-data: {path} is missing (a folder laid out like shared/data)")
    args = [item for flag, path in sources.items() for item in (flag, str(path))]
    subprocess.run(
        [sys.executable, "-m", "data_prep", "build", *args, "--skip-bad-files",
         "--vocab-size", str(s.vocab_size), "--seq-lens", str(s.seq_len), "--val-fraction", "0.05",
         "--num-shards", "2", "--out", str(out),
         "--seed", "1", "--workers", "2"],
        check=True, cwd=REPO_ROOT, env=cpu_env(), stdout=subprocess.DEVNULL,
    )
    return out


def ds_config(spec: RunSpec, s: Settings) -> dict[str, Any]:
    """The DeepSpeed JSON of one run, engine mechanics only: ZeRO-0, global-norm clipping, the optimizer
    under test (its lr and the batch are the RUN.json's, fp32 is run.precision auto on CPU)."""
    if spec.optimizer == "lamb":
        optimizer = {"type": "ExactLamb", "params": {"betas": [0.9, 0.999], "eps": 1e-6,
                                                     "weight_decay": s.weight_decay, "bias_correction": True,
                                                     "trust_clip": None, "adapt_all": s.lamb_adapt_all}}
    else:
        optimizer = {"type": "AdamW", "params": {"betas": [0.9, 0.999], "eps": 1e-6,
                                                 "weight_decay": s.weight_decay, "torch_adam": True}}
    return {"gradient_clipping": s.gradient_clipping, "zero_optimization": {"stage": 0},
            "optimizer": optimizer, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def run_config(spec: RunSpec, s: Settings, shards: Path, folder: Path, ranks: int) -> Path:
    """RUN.json (+ its DeepSpeed JSON) for one run, written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ds.json").write_text(json.dumps(ds_config(spec, s), indent=2), encoding="utf-8")
    steps = spec.steps(s)
    config = {
        "run": {"dir": str(folder / "run"), "seed": s.seed, "phases": ["phase1"]},
        "model": {"preset": "tiny", "overrides": {"hidden_size": s.hidden, "num_hidden_layers": s.layers,
                                                  "num_attention_heads": s.heads,
                                                  "intermediate_size": s.intermediate}},
        "data": {"shards": str(shards), "num_workers": 0},
        "phase1": {"seq_len": s.seq_len, "ds_config": "ds.json", "steps": steps, "lr": spec.lr(s),
                   "batch_size": spec.batch(s), "micro_batch_size": s.base_batch // ranks,
                   "warmup_fraction": spec.warmup_fraction(s), "decay_power": 0.5},
        "checkpoint": {"every_steps": steps + 1, "keep_last": 1, "export_at_phase_end": False},
        "logging": {"progress_bar": False, "val_every_steps": steps // s.val_points,
                    "val_batches": s.val_batches, "tensorboard": True},
    }
    path = folder / "run.json"
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


def command(config: Path, ranks: int) -> list[str]:
    """One plain process at --ranks 1; else the DeepSpeed launcher on CPU ranks over gloo."""
    if ranks == 1:
        return [sys.executable, "-m", "pretrain.train", "--config", str(config)]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
            "--master_port", str(port), "--no_local_rank", "--module", "pretrain.train",
            "--config", str(config)]


@dataclass
class Results:
    """The results file: settings, the command that made it, one entry per finished run."""

    path: Path
    settings: Settings
    runs: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    reference: dict[str, float] = field(default_factory=dict)  # losses that need no training

    @classmethod
    def open(cls, path: Path, settings: Settings) -> Results:
        if not path.is_file():
            return cls(path, settings)
        data = json.loads(path.read_text(encoding="utf-8"))
        saved = data.get("settings", {})
        mine = json.loads(json.dumps(asdict(settings)))
        keys = (set(saved) | set(mine)) - set(GRID_FIELDS)
        differ = sorted(k for k in keys if saved.get(k) != mine.get(k))
        if differ:
            raise SystemExit(f"--results {path}: made with other settings (differ: {', '.join(differ)}); "
                             "give another --results or delete it")
        return cls(path, settings, data.get("runs", {}), data.get("command", ""), data.get("reference", {}))

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"settings": asdict(self.settings), "command": self.command, "reference": self.reference,
                "runs": self.runs}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def sweep(results: Results, todo: list[RunSpec], shards: Path, work: Path, parallel: int, ranks: int) -> None:
    """Run `todo` at most `parallel` at a time; each finished run is saved before the next starts."""
    s = results.settings
    code, code_hash = snapshot_code(work)
    pending = list(todo)
    running: list[tuple[RunSpec, subprocess.Popen, float, Any]] = []
    while pending or running:
        while pending and len(running) < parallel:
            spec = pending.pop(0)
            folder = work / spec.key
            if folder.exists():
                shutil.rmtree(folder)  # a run cut short by an interrupted sweep starts over
            config = run_config(spec, s, shards, folder, ranks)
            log = open(folder / "train.log", "wb")  # noqa: SIM115 (closed when the run ends)
            # cwd = the copy: `python -m` puts the current folder first on sys.path
            proc = subprocess.Popen(command(config, ranks), cwd=code, env=cpu_env(code), stdout=log,
                                    stderr=subprocess.STDOUT)
            running.append((spec, proc, time.monotonic(), log))
            print(f"started {spec.key}: batch {spec.batch(s)}, {spec.steps(s)} steps, lr {spec.lr(s):.3g}",
                  flush=True)
        time.sleep(0.5)
        for item in list(running):
            spec, proc, started, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            entry = read_run(spec, s, work / spec.key, time.monotonic() - started, proc.returncode)
            entry["code"] = code_hash
            results.runs[spec.key] = entry
            results.save()
            print(f"done {spec.key}: {entry['status']}, held-out MLM loss {entry['final_val_mlm_loss']}, "
                  f"{entry['wall_s']} s", flush=True)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, two batches, 512 samples: a minute, for tests")
    parser.add_argument("--results", type=Path, help="results JSON (default: docs/large_batch.json; --quick: "
                                                    "WORK/large_batch.json)")
    parser.add_argument("--plot", type=Path, help="PNG (default: beside --results, large_batch.png)")
    parser.add_argument("--work", type=Path, help="runs and shards (default: runs/bench_large_batch[_quick])")
    parser.add_argument("--shared-data", type=Path, default=REPO_ROOT.parent / "shared" / "data")
    parser.add_argument("--parallel", type=int, default=2, help="runs side by side (default 2)")
    parser.add_argument("--ranks", type=int, default=1, help="DeepSpeed ranks per run (2: multi-rank path)")
    parser.add_argument("--report-only", action="store_true", help="no training: table + plot from --results")
    for name, value in asdict(Settings()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, tuple):
            shown = ",".join(map(str, value))
            parser.add_argument(flag, default=None, help=f"comma-separated, default {shown}")
        elif isinstance(value, bool):
            parser.add_argument(flag, default=None, choices=("true", "false"),
                                help=f"default {str(value).lower()}")
        else:
            parser.add_argument(flag, type=type(value), default=None, help=f"default {value:g}" if isinstance(
                value, float) else f"default {value}")
    args = parser.parse_args(argv)
    if args.parallel < 1 or args.ranks < 1:
        parser.error(f"--parallel {args.parallel} / --ranks {args.ranks}: must be >= 1")
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for name, default in asdict(Settings()).items():
        given = getattr(args, name)
        if given is None:
            continue
        if isinstance(default, bool):
            given = given == "true"
        elif isinstance(default, tuple):
            try:
                given = tuple(type(default[0])(v) for v in given.split(","))
            except ValueError:
                parser.error(f"--{name.replace('_', '-')} {given!r}: expected comma-separated numbers")
        values[name] = given
    settings = Settings(**values)
    settings.check()
    if settings.base_batch % args.ranks:
        parser.error(f"--ranks {args.ranks}: the base batch {settings.base_batch} is not divisible by it")
    suffix = "_quick" if args.quick else ""
    args.work = (args.work or REPO_ROOT / "runs" / f"bench_large_batch{suffix}").resolve()
    docs = REPO_ROOT / "docs" / "large_batch.json"
    default_results = args.work / "large_batch.json" if args.quick else docs
    args.results = (args.results or default_results).resolve()
    args.plot = (args.plot or args.results.with_suffix(".png")).resolve()
    return args, settings


def main(argv: list[str] | None = None) -> int:
    args, settings = parse_args(argv)
    results = Results.open(args.results, settings)
    # finished runs (ok or diverged) are kept; a run that failed for another reason is tried again
    todo = [spec for spec in plan(settings)
            if not results.runs.get(spec.key, {}).get("status", "failed").startswith(("ok", "diverged"))]
    print(f"{len(plan(settings)) - len(todo)} runs already in {args.results}, {len(todo)} to run", flush=True)
    if todo and not args.report_only:
        argv_used = sys.argv[1:] if argv is None else argv
        results.command = shlex.join(["python", "bench/large_batch.py", *argv_used])
        build_shards(args.shared_data.resolve(), args.work / "shards", settings)
        sweep(results, todo, args.work / "shards", args.work, args.parallel, args.ranks)
    if not results.reference and (args.work / "shards" / "manifest.json").is_file():
        loss = unigram_loss(args.work / "shards", settings.seq_len)
        results.reference = {"unigram_val_mlm_loss": round(loss, 4)}
        results.save()
    unigram = results.reference.get("unigram_val_mlm_loss")
    print(table(results.runs, settings, unigram))
    print("\n".join(ratio_lines(results.runs, settings)))
    try:
        plot(results.runs, settings, args.plot, unigram)
        print(f"plot: {args.plot}")
    except ImportError:
        print("plot skipped: matplotlib is missing (pip install -e '.[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
