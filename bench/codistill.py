"""Experiment: a tiny BERT trained alone vs codistilled in 2 groups (same steps, same per-group batch).

    python bench/codistill.py [--out runs/bench_codistill] [--shared-data ../shared/data] [--steps 300]
                              [--preset tiny] [--micro-batch 16] [--burn-in 0.3] [--refresh-every 10]
                              [--alpha 1.0] [--temperature 1.0] [--val-every 25] [--shards DIR]
                              [--same-data]

Both arms are ONE 2-rank job of the real driver (`deepspeed pretrain/train.py`) with 2 groups x 1 rank:
  alone        codistill.alpha = 0: each group is bit-for-bit the model trained by itself (tested in
               tests/codistill/test_multirank.py), so the two groups are two independent models;
  codistilled  codistill.alpha = --alpha after --burn-in of the steps, teachers refreshed every
               --refresh-every steps.
Groups use seeds s and s+1 in both arms, so group g starts from the same weights and sees the same
batches in both arms; only the distillation term differs. Group g reads part g of 2 disjoint halves
of the training data (the paper's setting, `codistill.disjoint_data`); --same-data gives both
groups all of it, in their own orders. Shards are built from ../shared/data
(WikiExtractor sample + the Gutenberg novels) unless --shards names a data_prep folder.

Writes <out>/codistill.png (validation MLM loss per group and arm; the final ensembles as markers)
and <out>/codistill.md (the table), and prints the table and the ratios codistilled / alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pretrain.run_folder import metrics_path  # noqa: E402

ARMS = ("alone", "codistilled")


def cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    return env


def build_shards(shared: Path, out: Path) -> Path:
    if (out / "manifest.json").is_file():
        return out
    books = shared / "books" / "nltk_gutenberg"
    wiki = shared / "wikipedia" / "wikiextractor_sample"
    for path in (books, wiki):
        if not path.is_dir():
            raise SystemExit(f"--shared-data: {path} is missing")
    subprocess.run(
        [sys.executable, "-m", "data_prep", "build", "--wikiextractor", str(wiki), "--books", str(books), "--skip-bad-files",
         "--vocab-size", "4000", "--seq-lens", "64", "--val-fraction", "0.05", "--out", str(out),
         "--seed", "1", "--workers", "2"],
        check=True, cwd=REPO_ROOT, env=cpu_env(),
    )
    return out


def run_config(args: argparse.Namespace, shards: Path, arm: str) -> Path:
    run_dir = args.out / arm
    config = {
        "run": {"dir": str(run_dir), "seed": 11, "phases": ["phase1"]},
        "model": {"preset": args.preset},
        "data": {"shards": str(shards), "num_workers": 0},
        "phase1": {
            "seq_len": 64, "ds_config": str(REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json"),
            "micro_batch_size": args.micro_batch, "gradient_accumulation_steps": 1,
            "steps": args.steps, "warmup_fraction": 0.1, "lr": args.lr,
        },
        "checkpoint": {"every_steps": args.steps, "keep_last": 1, "export_at_phase_end": False},
        "logging": {"progress_bar": False, "val_every_steps": args.val_every, "val_batches": args.val_batches},
        "codistill": {
            "enabled": True, "groups": 2, "alpha": args.alpha if arm == "codistilled" else 0.0,
            "burn_in_steps": int(args.burn_in * args.steps), "refresh_every": args.refresh_every,
            "temperature": args.temperature, "targets": ["mlm"], "exchange": "collective",
            "disjoint_data": not args.same_data,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{arm}.json"
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return path


def launch(config: Path) -> None:
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
    subprocess.run([launcher, "--num_gpus", "2", str(REPO_ROOT / "pretrain" / "train.py"), "--config", str(config)],
                   check=True, cwd=REPO_ROOT, env=cpu_env())


def read_arm(out: Path, arm: str) -> dict[str, Any]:
    curves, finals = {}, []
    for group in range(2):
        rows = [json.loads(line) for line in
                metrics_path(out / arm / f"group{group}").read_text(encoding="utf-8").splitlines()]
        curves[group] = sorted({r["step"]: r["val/mlm_loss"] for r in rows if "val/mlm_loss" in r}.items())
        finals.append(json.loads((out / arm / f"group{group}" / "codistill_final.json").read_text(encoding="utf-8")))
    return {"curves": curves, "finals": finals}


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| arm | val MLM loss group 0 | group 1 | mean of the two | ensemble (avg. probabilities) | churn |",
             "|---|---|---|---|---|---|"]
    for arm in ARMS:
        finals = results[arm]["finals"]
        own = [f["codistill/final_val_mlm_loss"] for f in finals]
        lines.append(f"| {arm} | {own[0]:.4f} | {own[1]:.4f} | {sum(own) / 2:.4f} | "
                     f"{finals[0]['codistill/final_ensemble_val_mlm_loss']:.4f} | {finals[0]['codistill/final_churn']:.3f} |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"alone": "tab:blue", "codistilled": "tab:red"}
    for arm in ARMS:
        for group, style in ((0, "-"), (1, "--")):
            xs, ys = zip(*results[arm]["curves"][group], strict=True)
            ax.plot(xs, ys, style, color=colors[arm], label=f"{arm}, group {group}")
        ensemble = results[arm]["finals"][0]["codistill/final_ensemble_val_mlm_loss"]
        ax.scatter([steps], [ensemble], marker="*", s=120, color=colors[arm], label=f"{arm}: ensemble of both")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation MLM loss")
    ax.set_title("tiny BERT: trained alone vs codistilled (2 groups)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "bench_codistill")
    parser.add_argument("--shared-data", type=Path, default=REPO_ROOT.parent / "shared" / "data")
    parser.add_argument("--shards", type=Path, default=None, help="a data_prep folder with seq 64 (skips building)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--burn-in", type=float, default=0.3, help="fraction of the steps without distillation")
    parser.add_argument("--refresh-every", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--same-data", action="store_true", help="both groups read all the data (default: halves)")
    parser.add_argument("--skip-training", action="store_true", help="only re-read the runs and redraw")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    if not args.skip_training:
        shards = args.shards or build_shards(args.shared_data, args.out / "shards")
        for arm in ARMS:
            launch(run_config(args, shards.resolve(), arm))
    results = {arm: read_arm(args.out, arm) for arm in ARMS}
    text = table(results)
    plot(results, args.out / "codistill.png", args.steps)
    (args.out / "codistill.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    alone, codist = (results[arm]["finals"] for arm in ARMS)
    mean = {arm: sum(f["codistill/final_val_mlm_loss"] for f in results[arm]["finals"]) / 2 for arm in ARMS}
    print(f"ratio codistilled/alone: mean single-model val loss {mean['codistilled'] / mean['alone']:.4f}, "
          f"churn {codist[0]['codistill/final_churn'] / max(alone[0]['codistill/final_churn'], 1e-12):.4f}")
    print(f"plot: {args.out / 'codistill.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
