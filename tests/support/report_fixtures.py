"""A finished run laid out as the demo leaves it, for the report and model-card tests, without training:

    out/data/                      tiny shards (tests/support/pretrain_fixtures.py)
    out/run/config.resolved.json   what the driver writes, from its own plan_run on those shards (2 ranks)
    out/run/tensorboard/metrics.jsonl, out/run/run_clock.json
                                   written by the driver's MetricsWriter in two "processes": the first
                                   stops after global step 6, the second resumes from the step-4 checkpoint
    out/run/checkpoints/phase2-step4/{run_config.json,trainer_state.json}   the exported checkpoint's JSON
    out/model/                     the export's export_info.json and model card (pretrain/report/model_card.py)
    out/squad/results.json, out/squad_random_init/results.json     SQuAD's results, as `squad finetune` writes
    out/glue/mrpc/results.json     a GLUE result in the documented layout
    out/other_model/ + out/other_squad/results.json                a fine-tune of a model from another run

The clock's start is moved back (`HOURS_PER_PROCESS`) so the run's wall-clock and device-hours are hours,
not the test's milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pretrain.config.load import load_config
from pretrain.distributed.info import DistInfo
from pretrain.metrics.quality import QualityPlan, QualitySection
from pretrain.metrics.writer import MetricsWriter
from pretrain.report.model_card import card_facts, write_model_card
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

RANKS = 2
HOURS_PER_PROCESS = 5.0
# global step -> val/mlm_acc: the default marks 0.3, 0.5, 0.65 are reached at steps 4, 6 and 10; 0.72 is not
ACCURACY = {2: 0.2, 4: 0.35, 6: 0.55, 8: 0.6, 10: 0.7}
SQUAD_SCORES = {"exact_match": 3.5, "f1": 7.25}
GLUE_MEDIAN = {"f1": 81.25, "accuracy": 70.5}


def _log_process(run_dir: Path, steps: range, config: dict[str, Any]) -> None:
    writer = MetricsWriter(run_dir / "tensorboard", enabled=True,
                           quality=QualityPlan(run_dir, RANKS, QualitySection(config["logging"]["quality_targets"])))
    writer.quality.clock.started -= HOURS_PER_PROCESS * 3600  # as if this process had run for hours
    phase1 = config["phase1"]["steps"]
    batch = {name: ds["train_batch_size"] for name, ds in config["resolved"]["ds_configs"].items()}
    for step in steps:
        phase, phase_step = ("phase1", step) if step <= phase1 else ("phase2", step - phase1)
        samples = min(step, phase1) * batch["phase1"] + max(0, step - phase1) * batch["phase2"]
        values = {"loss/mlm": 6.0 - 0.3 * step, "acc/mlm": ACCURACY.get(step, 0.05 * step), "perf/seq_per_s": 40.0 + step}
        if step in ACCURACY:
            values.update({"val/mlm_loss": 5.5 - 0.3 * step, "val/mlm_acc": ACCURACY[step]})
        writer.scalars(step, values, extra={"phase": phase, "phase_step": phase_step, "samples": samples})
    writer.close()


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def build_demo_like_run(out: Path) -> Path:
    """The folder of the module docstring; returns out/run."""
    from pretrain.plan.run_plan import plan_run

    shards = build_shards(out / "data", train=32, val=8)
    run_dir = out / "run"
    run_json = tiny_run_config(out / "run.json", shards, run_dir)
    plan = plan_run(load_config(run_json), DistInfo(rank=0, world_size=RANKS, local_rank=0, device=torch.device("cpu")),
                    verify_checksums=False)
    config = plan.resolved
    _write_json(run_dir / "config.resolved.json", config)
    _log_process(run_dir, range(1, 7), config)  # stopped after step 6
    _log_process(run_dir, range(5, 11), config)  # resumed from the checkpoint after step 4
    tag = run_dir / "checkpoints" / "phase2-step4"
    _write_json(tag / "run_config.json", config)
    _write_json(tag / "trainer_state.json", {"phase": "phase2", "step": 4, "samples_seen": 80, "complete": True})
    model = out / "model"
    _write_json(model / "export_info.json", {"source": str(tag), "max_abs_logit_difference": 0.0})
    write_model_card(model, card_facts(tag.parent, tag.name, config), str(model))
    _write_json(out / "squad" / "results.json", {"model": str(model), "scores": SQUAD_SCORES, "version": 1,
                                                 "init": "model"})
    _write_json(out / "squad_random_init" / "results.json",
                {"model": str(model), "scores": {"exact_match": 0.5, "f1": 2.0}, "version": 1, "init": "random"})
    _write_json(out / "glue" / "mrpc" / "results.json",
                {"task": "mrpc", "model": str(model), "median": GLUE_MEDIAN, "seeds": [{"seed": 1}, {"seed": 2}]})
    _write_json(out / "other_model" / "export_info.json", {"source": str(out / "elsewhere" / "checkpoints" / "x")})
    _write_json(out / "other_squad" / "results.json", {"model": str(out / "other_model"), "scores": {
        "exact_match": 99.0, "f1": 99.0}, "version": 1})
    return run_dir
