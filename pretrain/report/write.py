"""`./launch.sh report RUN_DIR [--usd-per-device-hour X]`: a run, written up for a person.

    python -m pretrain.report RUN_DIR [--usd-per-device-hour X] [--out DIR]

Writes RUN_DIR/report.md and RUN_DIR/report.png from what the run left on disk: metrics.jsonl (losses,
accuracy, throughput, MFU, the run's clock on every row), run_clock.json (its processes: stops and
resumes; pretrain/metrics/clock.py), config.resolved.json (the config that produced it), and the SQuAD /
GLUE results found beside it (pretrain/report/records.py). The time-to-target table answers "when did this
run reach masked-LM accuracy X, and what did it cost": wall-clock, device-hours and samples at the first
validation that reached each mark of logging.quality_targets (and the price, given one). The model cards
of the run's exports are regenerated with the fine-tune results found (pretrain/report/card_refresh.py).

It reads inside RUN_DIR and, beside it, only folders that are this user's alone; every file it writes goes
through a temp file renamed over the name, so no link planted there is written through (pretrain/report/trust.py).

`--help` imports no third-party module: matplotlib is imported only to draw (pretrain/report/plot.py), the
Hub's card types only to write a card (pretrain/report/model_card.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pretrain.checkpointing.cadence import interval_advice, measured_save_seconds
from pretrain.metrics.clock import STARTUP_MARKS, ProcessSpan, span_of
from pretrain.metrics.goodput import Accounting, account, read_faults
from pretrain.metrics.quality import DEFAULT_QUALITY_TARGETS
from pretrain.report.card_refresh import refresh_card
from pretrain.report.plot import draw_report
from pretrain.report.records import (
    RunFacts,
    TargetRow,
    exports_of_run,
    finetune_results,
    objective_text,
    read_rows,
    row_samples,
    row_wall_s,
    schedule_text,
)
from pretrain.report.trust import read_json, write_file
from pretrain.run_folder import CLOCK_FILE, REPORT_MD, REPORT_PNG, RESOLVED_CONFIG, metrics_path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="./launch.sh report",
        description="Write RUN_DIR/report.md and report.png: curves, time to target, stops and resumes, the config, "
                    "fine-tune results; regenerate the exports' model cards.")
    parser.add_argument("run_dir", type=Path, help="the run folder (run.dir: tensorboard/, config.resolved.json)")
    parser.add_argument("--usd-per-device-hour", type=float, default=None, metavar="X",
                        help="price of one device for one hour; adds a cost column (device-hours x X)")
    parser.add_argument("--out", type=Path, default=None, help="where report.md and report.png go (default: RUN_DIR)")
    parser.add_argument("--no-model-cards", action="store_true",
                        help="leave the exports' README.md as they are (default: regenerate them with the results)")
    return parser


def time_to_targets(rows: list[dict[str, Any]], marks: list[float], config: dict[str, Any]) -> list[TargetRow]:
    """The first validation at or above each mark, with the clock's figures on that row."""
    found = []
    for mark in sorted(marks):
        row = next((r for r in rows if "val/mlm_acc" in r and r["val/mlm_acc"] >= mark), None)
        if row is None:
            found.append(TargetRow(mark, None))
            continue
        device_hours = row.get("time/device_hours")
        found.append(TargetRow(mark, row, row_wall_s(row),
                               float(device_hours) if isinstance(device_hours, int | float) else None,
                               row_samples(row, config)))
    return found


def read_run(run_dir: Path, price: float | None) -> RunFacts:
    rows = read_rows(run_dir)
    config = read_json(run_dir / RESOLVED_CONFIG)
    config = config if isinstance(config, dict) else {}
    clock = read_json(run_dir / CLOCK_FILE)
    processes = clock.get("processes", []) if isinstance(clock, dict) else []
    marks = config.get("logging", {}).get("quality_targets", list(DEFAULT_QUALITY_TARGETS))
    left_out: list[str] = []
    finetune = finetune_results(run_dir, left_out)
    return RunFacts(run_dir, rows, config, processes, time_to_targets(rows, marks, config), finetune,
                    exports_of_run(run_dir), price, left_out)


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _num(value: Any, digits: int = 3) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, int | float) else "n/a"


def target_table(facts: RunFacts) -> list[str]:
    cost = facts.price is not None
    head = "| val/mlm_acc target | reached at step | val/mlm_acc | samples | wall-clock | device-hours |"
    lines = [head + (" cost (USD) |" if cost else ""), "|---" * (6 + cost) + "|"]
    best = max(facts.validations, key=lambda r: r["val/mlm_acc"], default=None)
    for target in facts.targets:
        if target.row is None:
            note = f"not reached (best {_num(best['val/mlm_acc'])} at step {best['step']})" if best else "not reached"
            lines.append(f"| {target.mark:g} | {note} |  |  |  |  |" + (" |" if cost else ""))
            continue
        samples = f"{target.samples:,.0f}" if target.samples is not None else "n/a"
        line = (f"| {target.mark:g} | {target.row['step']} | {_num(target.row['val/mlm_acc'])} | {samples} | "
                f"{_hours(target.wall_s)} | {_num(target.device_hours, 4)} |")
        if cost:
            line += f" {_num(target.device_hours * facts.price, 2) if target.device_hours is not None else 'n/a'} |"
        lines.append(line)
    return lines


def summary_lines(facts: RunFacts) -> list[str]:
    config, last = facts.config, (facts.rows[-1] if facts.rows else {})
    wall = sum(float(p.get("seconds", 0.0)) for p in facts.processes) or row_wall_s(last)
    device_hours = sum(p.get("ranks", 0) * p.get("seconds", 0.0) for p in facts.processes) / 3600 or None
    resumes = sum(1 for p in facts.processes[1:] if p.get("first_step") is not None)
    phases = []
    for name in config.get("run", {}).get("phases", []):
        done = [r["phase_step"] for r in facts.training if r.get("phase") == name and "phase_step" in r]
        phases.append(f"{name} {max(done) if done else 0}/{config.get(name, {}).get('steps', '?')}")
    samples = row_samples(last, config) if last else None
    lines = ["| | |", "|---|---|",
             f"| steps done | {', '.join(phases) or 'n/a'} |",
             f"| samples seen | {f'{samples:,.0f}' if samples is not None else 'n/a'} |",
             f"| wall-clock | {_hours(wall)} (the processes' running time, queue waits excluded) |",
             f"| device-hours | {_num(device_hours, 4)} (ranks x hours, summed over {len(facts.processes)} "
             f"process(es): 1 start + {resumes} resume(s)) |"]
    if facts.price is not None and device_hours is not None:
        lines.append(f"| cost | {_num(device_hours * facts.price, 2)} USD at {facts.price:g} USD per device-hour |")
    spans = process_spans(facts.processes)
    if any(span.steps for span in spans):
        costs = run_accounting(facts)
        lines.append(f"| goodput | {goodput_text(costs)} |")
        lines += downtime_lines(costs, facts)
    compiled = [r for r in facts.training if "compile/seconds" in r]
    if compiled:  # cumulative per process: the last process's counts (model.compile, pretrain/model/compiled.py)
        c = compiled[-1]
        lines.append(f"| compiled layers | {_num(c['compile/seconds'], 1)} s compiling, {c['compile/graph_breaks']:.0f} "
                     f"graph breaks, {c['compile/recompiles']:.0f} recompiles (the last process) |")
    val = facts.validations[-1] if facts.validations else None
    if val:
        lines.append(f"| last validation | step {val['step']}: val/mlm_loss {_num(val.get('val/mlm_loss'))}, "
                     f"val/mlm_acc {_num(val.get('val/mlm_acc'))} |")
    return lines


def throughput_lines(facts: RunFacts) -> list[str]:
    lines = ["| phase | median seq/s | median tokens/s | median MFU | median data wait (s/step) |", "|---|---|---|---|---|"]
    for name in facts.config.get("run", {}).get("phases", []) or sorted({r.get("phase", "run") for r in facts.training}):
        mine = [r for r in facts.training if r.get("phase") == name]

        def median(key: str, rows: list[dict[str, Any]] = mine) -> float | None:
            values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
            return statistics.median(values) if values else None

        mfu = median("perf/mfu")
        lines.append(f"| {name} | {_num(median('perf/seq_per_s'), 1)} | {_num(median('perf/tokens_per_s'), 0)} | "
                     f"{f'{mfu:.1%}' if mfu is not None else 'n/a (no peak FLOP/s known: CPU)'} | "
                     f"{_num(median('perf/data_wait_s'), 4)} |")
    return lines


def goodput_text(costs: Accounting) -> str:
    """The goodput and what the rest of the wall time went to, by pretrain/metrics/goodput.py's definitions."""
    ended = costs.launch_ends
    text = (f"{costs.goodput:.1%} (productive step time over wall time: {_num(costs.productive_s, 1)} s of "
            f"{_num(costs.wall_s, 1)} s; start-up {_num(costs.startup_s, 1)} s, step 1 of each process included; "
            f"{len(costs.faults)} fault(s) in the fault records, downtime {_num(costs.downtime_s, 1)} s from the "
            f"failed processes' last progress to the next first steps; {costs.redone_steps} step(s) redone)")
    if ended:
        text += (f"; {len(ended)} fault(s) ended a launch: the time until the run was launched again is not "
                 "counted")
    return text


def downtime_lines(costs: Accounting, facts: RunFacts) -> list[str]:
    """Detection as its own line (the part of the downtime before the agents acted: the hang limits that ran out),
    and the checkpoint interval advised with the run's own recovery time R per failure."""
    if not costs.outages:
        return []
    lines = [f"| detection | {_num(costs.detection_s, 1)} s of the downtime went by before a failure was seen (the "
             "hang limits that ran out: run.hang_timeout_minutes, run.startup_timeout_minutes) |"]
    save, recovery = measured_save_seconds(facts.run_dir), costs.recovery_s
    devices = max((int(p.get("ranks", 0)) for p in facts.processes), default=0)
    if save and recovery is not None and devices:
        lines.append(f"| checkpoint interval | {interval_advice(save, devices, recovery_seconds=recovery)} (R: this "
                     "run's mean downtime per fault) |")
    return lines


def run_accounting(facts: RunFacts) -> Accounting:
    return account(process_spans(facts.processes), read_faults(facts.run_dir))


def process_lines(facts: RunFacts) -> list[str]:
    """One row per process: when, how long, which steps, its start-up (seconds from its start to each mark), the
    downtime its first step ended (from the fault before it), and how many of its steps a later process redid."""
    lines = ["| # | started (UTC) | ranks | ran | steps logged | start-up (s): " + " / ".join(STARTUP_MARKS) +
             " | downtime before its first step (s) | its steps redone | |", "|---|---|---|---|---|---|---|---|---|"]
    spans = process_spans(facts.processes)
    costs = account(spans, read_faults(facts.run_dir))
    for index, (span, cost) in enumerate(zip(spans, costs.processes, strict=True)):
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(span.started_at))
        first, last = span.first_step, span.last_step
        outage = costs.outage_before(index)
        if cost.after is not None:
            kind = f"restart {span.restart} after a fault"
        elif span.restart:
            kind = f"restart {span.restart}, no fault recorded (a node joined)"
        elif index == 0:
            kind = "start"
        else:
            kind = "resume" if first is not None else "nothing logged (a finished run rerun)"
        steps = f"{first} - {last}" if first is not None else "none"
        startup = " / ".join(_num(span.startup.get(mark), 1) for mark in STARTUP_MARKS)
        downtime = _num(outage.seconds, 1) if outage is not None else ""
        lines.append(f"| {index + 1} | {started} | {span.ranks} | {_hours(span.seconds)} | {steps} | {startup} | "
                     f"{downtime} | {cost.redone_steps} | {kind} |")
    return lines


def process_spans(processes: list[dict[str, Any]]) -> list[ProcessSpan]:
    """run_clock.json's processes as the clock keeps them (a file from before a field was added: its default)."""
    return [span_of(process) for process in processes]


def finetune_lines(facts: RunFacts) -> list[str]:
    lines = ["| benchmark | task | metric | value | model | notes |", "|---|---|---|---|---|---|"]
    for result in facts.finetune:
        for metric, value in result.metrics.items():
            lines.append(f"| {result.benchmark} | {result.task} | {metric} | {_num(value, 2)} | `{result.model}` | "
                         f"{'; '.join(result.notes)} |")
    return lines


def recipe_lines(config: dict[str, Any]) -> list[str]:
    resolved = config.get("resolved", {})
    lines = ["| phase | seq len | global batch | micro-batch | steps | lr | lr schedule | optimizer | ZeRO |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in config.get("run", {}).get("phases", []):
        section, ds = config.get(name, {}), resolved.get("ds_configs", {}).get(name, {})
        lines.append(f"| {name} | {section.get('seq_len')} | {ds.get('train_batch_size')} | "
                     f"{ds.get('train_micro_batch_size_per_gpu')} | {section.get('steps')} | {section.get('lr')} | "
                     f"{schedule_text(config, name)} | {ds.get('optimizer', {}).get('type')} | "
                     f"{ds.get('zero_optimization', {}).get('stage', 0)} |")
    model = resolved.get("model_config", {})
    lines += ["", f"Model: preset `{config.get('model', {}).get('preset')}`, {model.get('num_hidden_layers')} layers, "
              f"hidden {model.get('hidden_size')}, vocab {model.get('vocab_size')}; {resolved.get('world_size')} ranks.",
              "", f"Objective: {objective_text(resolved)}."]
    return lines


def render_report(facts: RunFacts, picture: str | None, cards: list[Path]) -> str:
    name = facts.run_dir.resolve().name
    lines = [f"# Run report: {name}", "",
             f"`{facts.run_dir.resolve()}`, written {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} by "
             "`./launch.sh report` from the run's metrics.jsonl, run_clock.json and config.resolved.json.", "",
             "## Summary", "", *summary_lines(facts), "",
             "## Time to target", "",
             "The first validation whose masked-LM accuracy on the held-out shards (val/mlm_acc) reached each mark "
             "of `logging.quality_targets` (0.72 is MLPerf's BERT target, on its own data): the run's wall-clock "
             "(its processes' running time, from each process's start, across stops and resumes), device-hours "
             "(ranks x hours) and samples at that validation." + (" Cost = device-hours x the given price." if
                                                                    facts.price is not None else ""), "",
             *target_table(facts), ""]
    if picture:
        lines += ["## Curves", "", f"![loss, accuracy, throughput and MFU]({picture})", "",
                  "Top row against samples seen, bottom row against the run's wall-clock; dashed lines mark a resume "
                  "(a new process), dotted lines the phase-2 start, grey horizontal lines the quality targets. "
                  "Throughput is sequences of seq_len per second over all ranks, each step's global batch over the "
                  "wall time between optimizer steps; MFU the model FLOPs over the devices' peak (GPU only).", ""]
    lines += ["## Throughput", "", *throughput_lines(facts), "",
              "## Processes: stops and resumes", ""]
    lines += process_lines(facts) if facts.processes else ["No run_clock.json: the run predates the clock."]
    lines += ["", "## Fine-tune results", ""]
    lines += finetune_lines(facts) if facts.finetune else [
        "None found beside the run (SQuAD's results.json, GLUE's results.json with a `task`, in a folder beside "
        "RUN_DIR, of a model exported from it)."]
    if cards:
        lines += ["", "Model cards regenerated with these results: " + ", ".join(f"`{c}`" for c in cards) + "."]
    if facts.left_out:
        lines += ["", "Left out, not read: folders beside the run that name an export or a result but are not yours "
                  "alone (another user's, writable by others, or a link):", "",
                  *(f"- `{entry}`" for entry in facts.left_out)]
    lines += ["", "## Config", "", *recipe_lines(facts.config), "",
              "<details><summary>config.resolved.json</summary>", "", "```json",
              json.dumps(facts.config, indent=1), "```", "", "</details>", ""]
    return "\n".join(lines)


def write_report(run_dir: Path, price: float | None = None, out: Path | None = None,
                 model_cards: bool = True) -> Path:
    """report.md and report.png in `out` (default RUN_DIR); the model cards regenerated. Returns report.md."""
    facts = read_run(Path(run_dir), price)
    out = Path(out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    picture = None
    if facts.rows:
        draw_report(facts, out / REPORT_PNG)
        picture = REPORT_PNG
    cards = []
    if model_cards:
        for folder in facts.exports:
            mine = [result for result in facts.finetune if result.model == folder]
            if refresh_card(folder, facts.run_dir, mine):
                cards.append(folder / "README.md")
    path = out / REPORT_MD
    write_file(path, render_report(facts, picture, cards).encode("utf-8"))
    return path


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        print(f"report: {run_dir} is not a folder", file=sys.stderr)
        return 2
    if not (run_dir / RESOLVED_CONFIG).is_file() and not metrics_path(run_dir).is_file():
        print(f"report: {run_dir} is no run folder (no config.resolved.json, no tensorboard/metrics.jsonl)",
              file=sys.stderr)
        return 2
    if args.usd_per_device_hour is not None and not args.usd_per_device_hour >= 0:
        print(f"report: --usd-per-device-hour {args.usd_per_device_hour}: a price must be >= 0", file=sys.stderr)
        return 2
    path = write_report(run_dir, args.usd_per_device_hour, args.out, not args.no_model_cards)
    picture = path.with_name(REPORT_PNG)
    print(f"report: wrote {path}" + (f" and {picture}" if picture.is_file() else " (no metrics rows: no picture)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
