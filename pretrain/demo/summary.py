"""The demo's closing summary: data stats, per-phase losses and throughput, EM/F1, outputs.

Reads only what the steps left on disk (the manifest, the driver's metrics.jsonl or, failing that,
its TensorBoard files) and what `squad evaluate` printed, so it also works on a finished run folder.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from pretrain.metrics.clock import read_clock_file
from pretrain.metrics.goodput import account, read_faults
from pretrain.report.records import objective_text
from pretrain.run_folder import CLOCK_FILE, METRICS_FILE, REPORT_MD, REPORT_PNG, RESOLVED_CONFIG


class StepResult(Protocol):
    name: str
    seconds: float
    output: list[str]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar under run_dir, keyed by '<subfolder>/<tag>'."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    folders = sorted({events.parent for events in run_dir.rglob("events.out.tfevents.*")})
    for folder in folders:
        accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        accumulator.Reload()
        prefix = folder.relative_to(run_dir).as_posix()
        for tag in accumulator.Tags()["scalars"]:
            key = tag if prefix == "." else f"{prefix}/{tag}"
            # Wall-time order, not step order: a phase may restart its step count.
            events = sorted(accumulator.Scalars(tag), key=lambda event: event.wall_time)
            scalars[key] = [(event.step, event.value) for event in events]
    return scalars


CORPUS_TOTALS = ("documents", "sentences", "tokens", "val_documents")
# The random-weights SQuAD baseline: the same fine-tune without pretraining (the demo's step names).
BASELINE_FINETUNE = "squad finetune random weights"
BASELINE_EVALUATE = "squad evaluate random weights"
RANDOM_SQUAD_DIR = "squad_random_init"
# What the full recipe reaches, so the demo's number has a scale (SQuAD v1.1 dev, BERT-Large).
PUBLISHED_F1 = (
    "F1 90.9 BERT-Large (Devlin et al. 2019, Table 2); F1 90.58 LAMB 64K/32K recipe "
    "(You et al. 2020, Table 1): 8,599 steps, ~512M sequences, the full dev set"
)
PHASE_LOSSES = ("loss/total", "loss/mlm", "loss/nsp", "val/mlm_loss", "val/mlm_acc")
PHASE_RATES = ("perf/seq_per_s", "perf/tokens_per_s")
# What each kind of number in the table is, one phrase each, keyed by how its row name ends (render_table
# prints the ones whose rows are there). A toy run's numbers are easy to misread without them: a near-zero
# F1 and an NSP loss at chance are what this scale gives, not a broken pipeline.
READING_NOTES = (
    ("steps", "optimizer steps the phase ran, one global batch each"),
    ("goodput", "productive step time over wall time, over the run's processes: what start-up (step 1 "
                "included), faults and redone steps cost (a toy run's start-up is most of it)"),
    ("objective", "what the run trained: MLM + NSP on sentence pairs, or MLM alone on packed sentences"),
    ("loss/total", "training loss (MLM, + NSP when trained) at the phase's first step -> its last"),
    ("loss/mlm", "cross-entropy on the masked tokens; a uniform guess scores ln(vocab size), about 9 for 8K"),
    ("loss/nsp", "next-sentence cross-entropy; 0.693 = ln 2 is a coin flip, where a toy run stays: in a few "
                 "hundred steps the model learns masked words first, NSP much later"),
    ("val/mlm_loss", "masked-token loss on the held-out shards (a single value: one evaluation, at the phase end)"),
    ("val/mlm_acc", "share of the held-out masked tokens predicted exactly"),
    ("perf/seq_per_s (median)", "sequences of seq_len (padding included) per second over all ranks: the global "
                                "batch / the wall time between optimizer steps, median over the phase's steps"),
    ("perf/tokens_per_s (median)", "seq/s x seq_len, padding included"),
    ("fill-mask", "one whole word (4+ letters) hidden in each of the corpus sentences data prep kept as its "
                  "tokenizer probe: the share the export puts back exactly, the share among its 10 best guesses, and "
                  "the hidden word's median rank among all tokens (1 = first guess); beside it the same model with "
                  "random weights, which knows nothing (pretrain/report/fill_mask.py)"),
    ("fill-mask example", "a probe sentence, the word hidden in it, and the export's three best guesses"),
    ("SQuAD [UNK] share", "share of the fine-tune's tokens that its tokenizer could not name: above 1 % the "
                          "fine-tune refuses to start (--allow-unk)"),
    ("SQuAD v1.1 dev", "exact match and token F1 on the dev subset; near 0 at toy scale: a 4-layer model "
                       "pretrained for minutes on a small sample knows too little English to find answer spans"),
    ("SQuAD from random weights", "the same fine-tune without pretraining: the F1 gained over it is what the "
                                  "pretraining bought; one seed each, so at this scale a few points either way is "
                                  "noise (the fill-mask ranks above show what the model learned)"),
    ("SQuAD published (full recipe)", "what the full recipe reaches, for scale"),
)


def phase_rows(records: list[dict]) -> list[tuple[str, str]]:
    """Per phase: first -> last of the losses, median throughput (the first steps include warm-up).

    A record without a phase (the validation written after a phase's last step) belongs to the
    phase before it; only records with a training loss count as steps.
    """
    by_phase: dict[str, list[dict]] = {}
    phase = "run"
    for record in records:
        phase = str(record.get("phase", phase))
        by_phase.setdefault(phase, []).append(record)
    rows: list[tuple[str, str]] = []
    for phase, mine in by_phase.items():
        rows.append((f"{phase} steps", str(sum(1 for record in mine if "loss/total" in record))))
        for key in PHASE_LOSSES:
            values = [record[key] for record in mine if isinstance(record.get(key), int | float)]
            if len(values) > 1:
                rows.append((f"{phase} {key}", f"{values[0]:.3f} -> {values[-1]:.3f}"))
            elif values:  # "7.088 -> 7.088" would read as no progress; it is one number
                once = "one evaluation" if key.startswith("val/") else "one step"
                rows.append((f"{phase} {key}", f"{values[0]:.3f} ({once})"))
        for key in PHASE_RATES:
            values = [record[key] for record in mine if isinstance(record.get(key), int | float)]
            if values:
                rows.append((f"{phase} {key} (median)", f"{statistics.median(values):,.1f}"))
    return rows


def read_step_records(run_dir: Path) -> list[dict]:
    """The driver's per-step JSON lines (metrics.jsonl beside the TensorBoard files), in order."""
    records: list[dict] = []
    for path in sorted(run_dir.rglob(METRICS_FILE)):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by an interrupted run
            if isinstance(record, dict):
                records.append(record)
    return records


def squad_scores(evaluate_output: list[str]) -> dict[str, float] | None:
    """The {"exact_match": ..., "f1": ...} line `pretrain.finetune.squad evaluate` prints."""
    for line in reversed(evaluate_output):
        try:
            scores = json.loads(line)
        except ValueError:
            continue
        if isinstance(scores, dict) and "exact_match" in scores and "f1" in scores:
            return {"exact_match": float(scores["exact_match"]), "f1": float(scores["f1"])}
    return None


def summary_rows(out: Path, steps: Sequence[StepResult], corpus: str, squad: str | None) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [("pretraining data", corpus)]
    manifest_path = out / "data" / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        totals = manifest.get("totals", {})
        shown = [key for key in CORPUS_TOTALS if isinstance(totals.get(key), int)] or [
            key for key, value in totals.items() if isinstance(value, int)
        ]
        rows.append(("corpus", ", ".join(f"{totals[key]:,} {key}" for key in shown)))
        rows.append(("vocab", f"{manifest['vocab']['size']:,} WordPiece tokens trained on the corpus"))
        for seq_len, splits in sorted(manifest.get("seq_lens", {}).items(), key=lambda item: int(item[0])):
            counts = ", ".join(f"{split} {info['num_instances']:,}" for split, info in splits.items())
            rows.append((f"instances @ seq {seq_len}", counts))
    run_dir = out / "run"
    records = read_step_records(run_dir) if run_dir.is_dir() else []
    clock_path = run_dir / CLOCK_FILE
    if clock_path.is_file():  # what faults and restarts cost the run (pretrain/metrics/goodput.py)
        spans = read_clock_file(clock_path)["processes"]
        rows.append(("goodput", f"{account(spans, read_faults(run_dir)).goodput:.1%} over {len(spans)} process(es)"))
    resolved_path = run_dir / RESOLVED_CONFIG
    if resolved_path.is_file():  # what the run trained: MLM + NSP on sentence pairs, or MLM alone
        rows.append(("objective", objective_text(json.loads(resolved_path.read_text(encoding="utf-8")).get("resolved", {}))))
    rows += phase_rows(records)
    scalars = read_scalars(run_dir) if run_dir.is_dir() and not records else {}
    for tag, values in scalars.items():
        if "loss" in tag and len(values) > 1:
            rows.append(
                (
                    tag,
                    f"{values[0][1]:.3f} (step {values[0][0]}) -> {values[-1][1]:.3f} (step {values[-1][0]})",
                )
            )
    for tag, values in scalars.items():
        if "perf/" in tag and values:
            # The first steps include warm-up (allocation, first collectives): report the median.
            rows.append((tag + " (median)", f"{statistics.median(v for _, v in values):,.3g}"))
    rows += fill_mask_rows(out)
    rows += squad_rows(steps, squad)
    rows += unk_rows(out)
    rows += [(f"time: {step.name}", f"{step.seconds:.0f} s") for step in steps]
    rows += [
        ("shards + manifest", str(out / "data")),
        ("checkpoints + TensorBoard", f"{out / 'run'}  (./launch.sh tensorboard {out / 'run'})"),
        ("report", f"{out / 'run' / REPORT_MD} + {REPORT_PNG}  (./launch.sh report {out / 'run'})"),
        ("Hugging Face model", str(out / "model")),
        ("logs", str(out / "logs")),
    ]
    if squad:
        rows.append(("SQuAD predictions", f"{out / 'squad'}  (random weights: {out / RANDOM_SQUAD_DIR})"))
    return rows


def fill_mask_rows(out: Path, sentences: int = 200) -> list[tuple[str, str]]:
    """Does the export know words? One word hidden in each of the shards' probe sentences, filled by the export
    and by random weights of its shape (pretrain/report/fill_mask.py), with a few examples."""
    # deferred: the demo's first checks run without site-packages (tokenizers, torch)
    from data_prep.shard_format.tokenizer_probe import PROBE_NAME, Probe
    from pretrain.report.fill_mask import read_fill_mask

    model_dir, probe = out / "model", out / "data" / PROBE_NAME
    if not (model_dir / "config.json").is_file() or not probe.is_file():
        return []
    readout = read_fill_mask(model_dir, list(Probe.load(probe).sentences[:sentences]))
    ours, floor = readout.trained, readout.random
    rows = [("fill-mask", f"one word hidden in each of {readout.sentences} corpus sentences: exact {ours.top1:.1%}, "
                          f"in the top 10 {ours.top10:.1%}, median rank {ours.median_rank:,.0f} (random weights: "
                          f"{floor.top1:.1%}, {floor.top10:.1%}, median rank {floor.median_rank:,.0f})")]
    rows += [("fill-mask example", f"{text!r}: {answer!r} hidden, the model says {', '.join(top)}")
             for text, answer, top in readout.examples]
    return rows


def unk_rows(out: Path) -> list[tuple[str, str]]:
    """The share of [UNK] in the text each SQuAD fine-tune read (pretrain/finetune/vocab_check.py)."""
    rows = []
    for folder, name in (("squad", "SQuAD [UNK] share"), (RANDOM_SQUAD_DIR, "SQuAD [UNK] share, random weights")):
        results = out / folder / "results.json"
        check = json.loads(results.read_text(encoding="utf-8")).get("vocab_check") if results.is_file() else None
        if check:
            rows.append((name, f"{check['unk_share']:.2%} of {check['tokens']:,} tokens of {check['texts']:,} texts "
                               f"(tokenizer of {check['tokenizer']})"))
    return rows


def squad_rows(steps: Sequence[StepResult], squad: str | None) -> list[tuple[str, str]]:
    """EM/F1 after pretraining, beside the same fine-tune from random weights and the published figure.

    A toy run's F1 of a few points means nothing alone: next to random weights it shows what pretraining
    bought (or that it bought nothing, which is a broken pipeline); next to 90.9 it shows the scale.
    """
    names = ("squad evaluate", BASELINE_EVALUATE)
    found = {step.name: squad_scores(step.output) for step in steps if step.name in names}
    scores, baseline = found.get("squad evaluate"), found.get(BASELINE_EVALUATE)
    if not squad or scores is None:
        return []
    rows = [("SQuAD v1.1 dev", f"EM {scores['exact_match']:.2f}  F1 {scores['f1']:.2f}  ({squad})")]
    if baseline is not None:
        gain = scores["f1"] - baseline["f1"]
        rows.append(("SQuAD from random weights",
                     f"EM {baseline['exact_match']:.2f}  F1 {baseline['f1']:.2f}  "
                     f"(same fine-tune, no pretraining: pretraining bought {gain:+.2f} F1)"))
    rows.append(("SQuAD published (full recipe)", PUBLISHED_F1))
    return rows


def reading_notes(rows: list[tuple[str, str]]) -> list[str]:
    """One line per kind of number the table shows: what it counts and how to read it at toy scale."""
    names = [name for name, _ in rows]
    return [f"  {ending}: {note}" for ending, note in READING_NOTES if any(name.endswith(ending) for name in names)]


def render_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    rule = "-" * (width + 3 + max(len(value) for _, value in rows))
    lines = ["", "Demo summary", rule, *(f"{name:<{width}} | {value}" for name, value in rows), rule]
    notes = reading_notes(rows)
    if notes:
        lines += ["How to read the numbers:", *notes]
    return "\n".join(lines)
