"""What a run folder holds, read back for people: its metrics rows, clock, config, exports and the
fine-tune results that belong to it. Shared by the report (pretrain/report/write.py) and the model card
(pretrain/report/model_card.py); standard library only, so neither needs torch.

Fine-tune results are found beside the run (in RUN_DIR and its parent folder, a few levels down, as the
demo lays them out: <out>/run, <out>/model, <out>/squad) and kept when the model they fine-tuned came from
this run: the model folder lies inside RUN_DIR, or its export_info.json names a checkpoint inside RUN_DIR.
Beside RUN_DIR only folders that are this user's alone are read or entered (pretrain/report/trust.py): another
user's folder that names our run is left out and listed, never counted.

    SQuAD  results.json that `squad finetune` writes in its --out: "model", "scores" (exact_match, f1),
           "version", "init" ("random" for the random-weights baseline)
    GLUE   results.json or *_results.json in `glue finetune`'s --out with "task" (a GLUE task name),
           "model", and the metrics in "median" (over seeds; else "scores" or "metrics"): metric -> number;
           "seeds", when a list, says how many seeds the median is over
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.finetune.layout import RESULTS, RESULTS_GLOB
from pretrain.report.trust import claims_results, not_yours_alone, read_json
from pretrain.run_folder import CHECKPOINTS, EXPORT_INFO, LOGS, TENSORBOARD, metrics_path
from pretrain.schedules.lr import ScheduleSettings, schedule_line

SEARCH_DEPTH = 3  # folder levels below RUN_DIR and its parent searched for results and exports
SKIPPED_FOLDERS = {CHECKPOINTS, TENSORBOARD, LOGS, "data", "squad_data", ".git", "__pycache__"}
GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli", "ax")


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows in order; a line cut by a killed process is skipped."""
    path = metrics_path(run_dir)
    rows: list[dict[str, Any]] = []
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def last_validation(rows: list[dict[str, Any]], up_to_step: int | None = None) -> dict[str, Any] | None:
    """The last row with val/mlm_acc at or before `up_to_step` (None: any)."""
    found = None
    for row in rows:
        if "val/mlm_acc" in row and (up_to_step is None or row["step"] <= up_to_step):
            found = row
    return found


def global_step(run_config: dict[str, Any], phase: str, phase_step: int) -> int:
    """TensorBoard's x-axis: phase 2 continues after phase 1's steps (as the trainer counts)."""
    offset = run_config.get("phase1", {}).get("steps", 0) if phase == "phase2" else 0
    return int(offset) + int(phase_step)


def _is_inside(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def _candidates(path_text: str, near: Path) -> list[Path]:
    """A path as written in a results file: absolute, or relative to the current folder or to one of the
    folders above the file that names it (the command may have run elsewhere)."""
    path = Path(path_text)
    if path.is_absolute():
        return [path]
    return [Path.cwd() / path, *(parent / path for parent in list(near.parents)[:SEARCH_DEPTH + 1])]


def located(path_text: str, near: Path) -> Path:
    """A path as written in a file beside the run: absolute as written, else the first of `_candidates` that exists
    (or as written, relative to the current folder)."""
    return next((path for path in _candidates(path_text, near) if path.exists()), Path(path_text))


def source_inside(source: str, near: Path, run_dir: Path) -> bool:
    """Is an export's source checkpoint (export_info.json's "source") inside RUN_DIR? An absolute path is
    judged as written (a pruned step checkpoint no longer exists); a relative one where it exists."""
    if Path(source).is_absolute():
        return _is_inside(Path(source), run_dir)
    return any(_is_inside(path, run_dir) for path in _candidates(source, near) if path.exists())


def model_belongs_to_run(model_text: str, results_file: Path, run_dir: Path) -> Path | None:
    """The model folder a results file names, when it came from this run; else None. Outside RUN_DIR, only a folder
    that is this user's alone is asked (another user's export_info.json could name any run)."""
    for candidate in _candidates(model_text, results_file):
        if not candidate.is_dir():
            continue
        if _is_inside(candidate, run_dir):
            return candidate
        if not_yours_alone(candidate) is not None:
            continue
        info = read_json(candidate / EXPORT_INFO)
        source = info.get("source") if isinstance(info, dict) else None
        if isinstance(source, str) and source_inside(source, candidate / EXPORT_INFO, run_dir):
            return candidate
    return None


def walk_beside(run_dir: Path, left_out: list[str] | None = None) -> Iterator[Path]:
    """Folders in RUN_DIR and beside it (its parent), SEARCH_DEPTH levels down, without checkpoints & co. Beside
    RUN_DIR, a folder that is not this user's alone is neither yielded nor entered; when it holds an export's
    record or a results file, "folder: why" is added to `left_out`."""
    seen: set[Path] = set()
    inside = run_dir.resolve()
    for root in (run_dir, run_dir.parent):
        root_depth = len(root.resolve().parts)
        for folder, subfolders, files in os.walk(root):
            here = Path(folder).resolve()
            foreign = None if here.is_relative_to(inside) else not_yours_alone(Path(folder))
            if foreign is not None and here != root.resolve():  # the parent itself is entered, never read
                subfolders[:] = []
                if left_out is not None and here not in seen and claims_results(files):
                    left_out.append(f"{here}: {foreign}")
                seen.add(here)
                continue
            subfolders[:] = sorted(name for name in subfolders if name not in SKIPPED_FOLDERS
                                   and len(here.parts) - root_depth < SEARCH_DEPTH)
            if here not in seen and foreign is None:
                seen.add(here)
                yield Path(folder)


@dataclass
class FinetuneResult:
    """One fine-tune's scores on a model of this run."""

    benchmark: str  # "SQuAD v1.1", "SQuAD v2.0", "GLUE"
    task: str  # "squad", or the GLUE task (mrpc, mnli-mm, ...)
    metrics: dict[str, float]
    model: Path  # the fine-tuned model folder (an export of this run)
    path: Path  # the results file
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"benchmark": self.benchmark, "task": self.task, "metrics": self.metrics, "model": str(self.model),
                "path": str(self.path), "notes": self.notes}


def _numbers(block: Any) -> dict[str, float]:
    if not isinstance(block, dict):
        return {}
    return {str(key): float(value) for key, value in block.items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def _glue_task(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    plain = name.lower().replace("-", "").replace("_", "")
    return name.lower() if any(plain.startswith(task) for task in GLUE_TASKS) else None


def parse_result(path: Path, data: Any) -> tuple[str, str, dict[str, float], list[str]] | None:
    """(benchmark, task, metrics, notes) of a SQuAD or GLUE results file; None for anything else."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        return None
    task = _glue_task(data.get("task"))
    if task is not None:
        for key in ("median", "scores", "metrics"):
            metrics = _numbers(data.get(key))
            if metrics:
                seeds = data.get("seeds")
                notes = [f"median of {len(seeds)} seeds"] if key == "median" and isinstance(seeds, list) else []
                return "GLUE", task, metrics, notes
        return None
    scores = _numbers(data.get("scores"))
    if path.name == RESULTS and {"exact_match", "f1"} <= set(scores):
        notes = ["fine-tuned from random weights (baseline)"] if data.get("init") == "random" else []
        return f"SQuAD v{'2.0' if data.get('version') == 2 else '1.1'}", "squad", scores, notes
    return None


def finetune_results(run_dir: Path, left_out: list[str] | None = None) -> list[FinetuneResult]:
    """Every SQuAD / GLUE result beside the run whose model came from it, in path order (`left_out`: walk_beside's)."""
    run_dir = Path(run_dir)
    found: list[FinetuneResult] = []
    for folder in walk_beside(run_dir, left_out):
        for path in sorted(folder.glob(RESULTS_GLOB)):
            data = read_json(path)
            parsed = parse_result(path, data)
            if parsed is None:
                continue
            model = model_belongs_to_run(data["model"], path, run_dir)
            if model is not None:
                benchmark, task, metrics, notes = parsed
                found.append(FinetuneResult(benchmark, task, metrics, model.resolve(), path.resolve(), notes))
    return found


def exports_of_run(run_dir: Path) -> list[Path]:
    """The Hugging Face folders exported from this run's checkpoints (RUN_DIR/export/<phase>, the demo's
    <out>/model, ...): folders with export_info.json whose source lies inside RUN_DIR (beside RUN_DIR: folders
    that are this user's alone; the source need not exist any more, a step checkpoint is pruned in time)."""
    run_dir = Path(run_dir)
    exports = []
    for folder in walk_beside(run_dir):
        info = read_json(folder / EXPORT_INFO)
        if isinstance(info, dict) and isinstance(info.get("source"), str) and (
                _is_inside(folder, run_dir) or source_inside(info["source"], folder / EXPORT_INFO, run_dir)):
            exports.append(folder.resolve())
    return sorted(exports)


# ---------------------------------------------------------------- what the report shows (write.py, plot.py)
@dataclass
class TargetRow:
    """One mark of the time-to-target table."""

    mark: float
    row: dict[str, Any] | None  # the first validation row at or above the mark (None: not reached)
    wall_s: float | None = None
    device_hours: float | None = None
    samples: float | None = None


@dataclass
class RunFacts:
    """Everything the report shows, read once."""

    run_dir: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any]
    processes: list[dict[str, Any]]
    targets: list[TargetRow]
    finetune: list[Any] = field(default_factory=list)  # run_records.FinetuneResult
    exports: list[Path] = field(default_factory=list)
    price: float | None = None
    left_out: list[str] = field(default_factory=list)  # folders beside the run not read: "folder: why"

    @property
    def validations(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if "val/mlm_acc" in row]

    @property
    def training(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if "loss/mlm" in row]


def samples_at(config: dict[str, Any], step: int) -> int | None:
    """Sequences seen after global step `step`, from the resolved batch sizes (rows written before the
    driver logged "samples")."""
    ds = config.get("resolved", {}).get("ds_configs", {})
    if not ds:
        return None
    first = int(config.get("phase1", {}).get("steps", 0)) if "phase1" in config.get("run", {}).get("phases", []) else 0
    batch1 = ds.get("phase1", {}).get("train_batch_size", 0)
    batch2 = ds.get("phase2", {}).get("train_batch_size", 0)
    if first and step <= first:
        return step * batch1
    return first * batch1 + (step - first) * batch2


def row_samples(row: dict[str, Any], config: dict[str, Any]) -> float | None:
    for key in ("time/samples", "samples"):
        if isinstance(row.get(key), int | float):
            return float(row[key])
    found = samples_at(config, row["step"])
    return float(found) if found is not None else None


def row_wall_s(row: dict[str, Any]) -> float | None:
    for key in ("time/wall_s", "wall_s"):
        if isinstance(row.get(key), int | float):
            return float(row[key])
    return None


def objective_text(resolved: dict[str, Any]) -> str:
    """What the run trained, from its resolved config (runs before the key trained MLM + NSP)."""
    objective = resolved.get("objective", "mlm+nsp")
    masking = resolved.get("mask_probability") or {}
    rate = f", {max(masking.values()):.0%} of the tokens masked" if masking else ""
    if objective == "mlm+nsp":
        return f"masked-LM + next-sentence prediction on sentence pairs{rate}"
    return f"masked-LM alone (no NSP) on {resolved.get('segments', 'packed')} inputs{rate}"


def schedule_text(config: dict[str, Any], phase: str) -> str:
    """A phase's lr schedule in words: the line the plan recorded (config.resolved.json's resolved.schedules), or,
    for a run from before that record, the same line rebuilt from the phase's keys (pretrain/schedules/lr.py)."""
    recorded = config.get("resolved", {}).get("schedules", {}).get(phase)
    if recorded:
        return str(recorded)
    section = config.get(phase, {})
    try:
        return schedule_line(ScheduleSettings.from_keys(section), int(section.get("steps", 0)))
    except (TypeError, ValueError) as err:  # a hand-edited file (ConfigError is a ValueError): say what is wrong
        return f"unreadable ({err})"
