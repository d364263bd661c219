"""Reading bench/large_batch.py's runs: each run's metrics, the unigram reference, table, ratios, plot.

Kept apart from the runner so a finished sweep can be re-read and redrawn (`--report-only`) without
training, and so the reading of the numbers (the rule's LAMB, the best grid point of each optimizer per
batch, ratios against the batch-B run of the same kind) lives in one place.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.run_folder import metrics_path  # noqa: E402

# rows of the main table: (key in best_by_batch, label)
KINDS = (("lamb", "LAMB (rule)"), ("adamw", "AdamW (best of grid"), ("lamb_best", "LAMB (best of grid"))


def read_run(spec: Any, s: Any, folder: Path, seconds: float, returncode: int) -> dict[str, Any]:
    """What the driver logged (metrics.jsonl) reduced to the numbers the table and the plot need."""
    batch = spec.batch(s)
    path = metrics_path(folder / "run")
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    rows = [json.loads(line) for line in lines]
    train = [r for r in rows if "loss/mlm" in r]
    val = sorted({r["step"]: r["val/mlm_loss"] for r in rows if "val/mlm_loss" in r}.items())
    tail = [r["loss/mlm"] for r in train[-max(1, len(train) // 10):]]
    finite = bool(val) and all(math.isfinite(v) for _, v in val) and returncode == 0
    # exit 3: the driver stopped after failures.max_consecutive_nonfinite NaN/inf steps, a result
    status = "ok" if finite else "diverged" if returncode in (0, 3) else f"failed (exit {returncode})"
    return {
        **asdict(spec), "key": spec.key, "batch": batch, "steps": spec.steps(s), "lr": spec.lr(s),
        "warmup_fraction": spec.warmup_fraction(s),
        "warmup_steps": math.ceil(spec.warmup_fraction(s) * spec.steps(s)),
        "status": status,
        "final_val_mlm_loss": val[-1][1] if finite else None,
        "val_curve": [[step * batch, value] for step, value in val],
        "first_train_mlm_loss": train[0]["loss/mlm"] if train else None,
        "last_train_mlm_loss": sum(tail) / len(tail) if tail else None,
        "wall_s": round(seconds, 1),
        "train_s": round(sum(r.get("perf/step_s", 0.0) for r in train), 1),
    }


def unigram_loss(shards: Path, seq_len: int) -> float:
    """The held-out MLM loss of a model that ignores the context: the training split's token frequencies
    (add-one) scored on every non-special token of the held-out split. A run above it has learned only
    which tokens are frequent."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.ipc as ipc

    manifest = json.loads((shards / "manifest.json").read_text(encoding="utf-8"))
    tokens = (shards / manifest["vocab"]["file"]).read_text(encoding="utf-8").splitlines()
    special = [i for i, t in enumerate(tokens) if t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")]
    counts = {}
    for split in ("train", "val"):
        total = np.zeros(len(tokens), dtype=np.int64)
        for shard in manifest["seq_lens"][str(seq_len)][split]["shards"]:
            ids = pc.list_flatten(ipc.open_file(str(shards / shard["file"])).read_all().column("input_ids"))
            total += np.bincount(ids.to_numpy(), minlength=len(tokens))
        total[special] = 0
        counts[split] = total
    train = counts["train"] + 1
    train[special] = 0
    logp = np.log(np.maximum(train, 1) / train.sum())
    return float(-(counts["val"] * logp).sum() / counts["val"].sum())


def _loss(entry: dict[str, Any] | None) -> float:
    value = entry.get("final_val_mlm_loss") if entry else None
    return float(value) if value is not None else math.inf


def _grid(settings: Any, name: str) -> tuple[float, ...]:
    return tuple(getattr(settings, f"{name}_grid", (1.0,)))


def best_by_batch(runs: dict[str, Any], settings: Any) -> dict[int, dict[str, dict[str, Any] | None]]:
    """{multiplier: {"lamb": the rule's run, "adamw"/"lamb_best": the grid point with the lowest loss}}."""
    out: dict[int, dict[str, dict[str, Any] | None]] = {}
    for k in settings.multipliers:
        best: dict[str, dict[str, Any] | None] = {"lamb": runs.get(f"lamb-k{k}-x1")}
        for name, key in (("adamw", "adamw"), ("lamb", "lamb_best")):
            grid = [runs[run] for f in _grid(settings, name) if (run := f"{name}-k{k}-x{f:g}") in runs]
            best[key] = min(grid, key=_loss) if grid else None
        out[k] = best
    return out


def _fmt_loss(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "not run"
    if entry.get("final_val_mlm_loss") is None:
        return entry.get("status", "?")
    return f"{entry['final_val_mlm_loss']:.4f}"


def _kinds(settings: Any) -> list[tuple[str, str]]:
    return [kind for kind in KINDS if kind[0] != "lamb_best" or len(_grid(settings, "lamb")) > 1]


def table(runs: dict[str, Any], settings: Any, unigram: float | None = None) -> str:
    """Markdown: batch x optimizer -> final held-out MLM loss, steps, wall time; then each grid."""
    best = best_by_batch(runs, settings)
    base = best.get(settings.multipliers[0], {})
    lines = [] if unigram is None else [
        "Unigram baseline (no context: the training split's token frequencies on the held-out split): "
        f"{unigram:.4f}",
        "",
    ]
    versions = sorted({run.get("code", "unrecorded") for run in runs.values()})
    if len(versions) > 1:
        lines += [f"WARNING: these runs executed {len(versions)} versions of pretrain/ + data_prep/ "
                  f"({', '.join(versions)}): rerun with a fresh --results to compare like with like.", ""]
    lines += [
        "| batch | steps | warmup steps | optimizer | lr | held-out MLM loss | vs. same kind at B | "
        "wall s | wall ÷ same kind at B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in settings.multipliers:
        for name, label in _kinds(settings):
            entry = best[k][name]
            if entry is None:
                short = label.split(" (")[0]
                lines.append(f"| {settings.base_batch * k} ({k}B) | | | {short} | | not run | | | |")
                continue
            ref = base.get(name)
            finite = ref is not None and math.isfinite(_loss(entry)) and math.isfinite(_loss(ref))
            delta = f"{(_loss(entry) / _loss(ref) - 1) * 100:+.1f} %" if finite else ""
            wall = f"{entry['wall_s'] / ref['wall_s']:.2f}" if ref and ref.get("wall_s") else ""
            shown = label if name == "lamb" else f"{label}, x{entry['lr_factor']:g})"
            lines.append(f"| {entry['batch']} ({k}B) | {entry['steps']} | {entry['warmup_steps']} | "
                         f"{shown} | {entry['lr']:.3g} | {_fmt_loss(entry)} | {delta} | "
                         f"{entry['wall_s']:.0f} | {wall} |")
    for name, title in (("adamw", "AdamW"), ("lamb", "LAMB")):
        grid = _grid(settings, name)
        if len(grid) < 2:
            continue
        lines += ["", f"{title} grid (final held-out MLM loss; lr = the rule's lr x factor; best in bold):",
                  "",
                  "| batch | " + " | ".join(f"x{f:g}" for f in grid) + " |", "|---|" + "---|" * len(grid)]
        for k in settings.multipliers:
            cells = []
            for f in grid:
                entry = runs.get(f"{name}-k{k}-x{f:g}")
                cell = _fmt_loss(entry) + (f" (lr {entry['lr']:.3g})" if entry else "")
                chosen = best[k]["adamw" if name == "adamw" else "lamb_best"]
                cells.append(f"**{cell}**" if entry is not None and entry is chosen else cell)
            lines.append(f"| {settings.base_batch * k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_lines(runs: dict[str, Any], settings: Any) -> list[str]:
    """Per batch: LAMB / best AdamW final loss; each kind's loss and wall time vs. its batch-B run."""
    best = best_by_batch(runs, settings)
    base = best.get(settings.multipliers[0], {})
    lines = []
    for k in settings.multipliers:
        lamb, adamw, lamb_best = best[k]["lamb"], best[k]["adamw"], best[k]["lamb_best"]
        if lamb is None or adamw is None:
            continue
        parts = [f"batch {lamb['batch']} ({k}B): loss LAMB / best AdamW {_loss(lamb) / _loss(adamw):.4f}"]
        if lamb_best is not None and len(_grid(settings, "lamb")) > 1:
            parts.append(f"best LAMB / best AdamW {_loss(lamb_best) / _loss(adamw):.4f}")
        for name, entry in (("LAMB", lamb), ("AdamW", adamw)):
            ref = base.get(name.lower())
            if ref is not None:
                parts.append(f"{name} loss / its B run {_loss(entry) / _loss(ref):.4f}, "
                             f"wall / its B run {entry['wall_s'] / ref['wall_s']:.2f}")
        lines.append("; ".join(parts))
    return lines


def plot(runs: dict[str, Any], settings: Any, path: Path, unigram: float | None = None) -> None:
    """Left: held-out loss vs. samples per batch. Right: final loss vs. batch (faint: every grid point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_by_batch(runs, settings)
    fig, (curves, finals) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.get_cmap("viridis")
    count = max(1, len(settings.multipliers) - 1)
    for i, k in enumerate(settings.multipliers):
        for name, style in (("lamb", "-"), ("adamw", "--")):
            entry = best[k][name]
            if entry is None or not entry["val_curve"]:
                continue
            xs, ys = zip(*entry["val_curve"], strict=True)
            label = f"{'LAMB (rule)' if name == 'lamb' else 'AdamW best'}, batch {entry['batch']}"
            curves.plot(xs, ys, style, color=colors(i / count), marker="o", markersize=3, label=label)
    for axes in (curves, finals) if unigram is not None else ():
        axes.axhline(unigram, color="gray", linestyle=":", linewidth=1, label="unigram (no context)")
    curves.set_xlabel("samples seen")
    curves.set_ylabel("held-out MLM loss")
    curves.set_title("held-out MLM loss vs. samples (equal samples per run)")
    curves.legend(fontsize=7, ncol=2)
    curves.grid(alpha=0.3)
    batches = [settings.base_batch * k for k in settings.multipliers]
    lines = (("lamb", "tab:red", "o", "-", "LAMB (sqrt rule, one lr)"),
             ("adamw", "tab:blue", "s", "-", "AdamW (sqrt rule, best of grid)"),
             ("lamb_best", "tab:red", "^", ":", "LAMB (best of grid)"))
    for name, color, marker, style, label in lines:
        if name == "lamb_best" and len(_grid(settings, "lamb")) < 2:
            continue
        ys = [_loss(best[k][name]) for k in settings.multipliers]
        finals.plot(batches, [y if math.isfinite(y) else float("nan") for y in ys], style, marker=marker,
                    color=color, label=label)
    for name, color in (("adamw", "tab:blue"), ("lamb", "tab:red")):
        for k in settings.multipliers:
            for f in _grid(settings, name):
                entry = runs.get(f"{name}-k{k}-x{f:g}")
                if entry is not None and math.isfinite(_loss(entry)):
                    finals.scatter([entry["batch"]], [_loss(entry)], s=14, color=color, alpha=0.3)
    finals.set_xscale("log", base=2)
    finals.set_xticks(batches, [str(b) for b in batches])
    finals.set_xlabel("global batch (sequences), equal samples seen")
    finals.set_ylabel("final held-out MLM loss")
    finals.set_title("final loss vs. batch (faint: every grid point)")
    finals.legend(fontsize=8)
    finals.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
