"""The real driver, in this process, stopped and resumed: its rows carry the run's clock and samples, its
run_clock.json holds both processes, its phase-end export has a model card that huggingface_hub parses, and
the report reads the folder it left."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.report.write import write_report
from pretrain.run_folder import CLOCK_FILE
from pretrain.train import main
from tests.support.pretrain_fixtures import build_shards, tiny_run_config


def test_a_stopped_and_resumed_run_keeps_its_clock_and_exports_a_card(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    shards = build_shards(tmp_path / "shards", seq_lens=(32,), train=32, val=8)
    run_dir = tmp_path / "run"
    run_json = tiny_run_config(tmp_path / "run.json", shards, run_dir)
    args = ["--config", str(run_json), '--run.phases=["phase1"]', "--phase1.steps=4", "--logging.val_every_steps=2"]
    assert main([*args, "--run.stop_after_steps=3"]) == 0  # checkpoint after step 3, then exit: a preemption
    first = json.loads((run_dir / CLOCK_FILE).read_text())["processes"]
    assert main(args) == 0  # the same command resumes at step 4 and exports
    clock = json.loads((run_dir / CLOCK_FILE).read_text())
    assert [(p["first_step"], p["last_step"], p["ranks"]) for p in clock["processes"]] == [(1, 3, 1), (4, 4, 1)]
    assert clock["processes"][0] == first[0], "the first process's record is kept as it left it"

    rows = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss/mlm" in row] == [1, 2, 3, 4]
    # what faults cost: every save's time, the run's goodput with every training row, each process's start-up
    assert [row["step"] for row in rows if "checkpoint/save_s" in row] == [2, 3, 4]  # every 2 steps, the stop, the end
    goodputs = [row["time/goodput"] for row in rows if "loss/mlm" in row]
    assert goodputs[0] == 0.0 and all(0 < value < 1 for value in goodputs[1:]), "step 1 of a process is start-up"
    for process in clock["processes"]:
        assert process["steps"] == process["last_step"] - process["first_step"] + 1 and process["step_seconds"] > 0
        assert list(process["startup"])[:2] == ["planned", "engine_built"] and "first_step" in process["startup"]
    assert "checkpoint_loaded" in clock["processes"][1]["startup"] and clock["processes"][1]["restart"] == 0
    assert all("wall_s" in row and "samples" in row for row in rows)
    assert [row["samples"] for row in rows if "loss/mlm" in row] == [8, 16, 24, 32], "global batch 8 per step"
    walls = [row["wall_s"] for row in rows]
    assert walls == sorted(walls) and walls[-1] >= first[0]["seconds"], "the resumed rows add the first process"
    validations = [row for row in rows if "val/mlm_acc" in row]
    assert [row["step"] for row in validations] == [2, 4]
    assert all(row["time/samples"] == row["samples"] and row["time/device_hours"] > 0 for row in validations)

    card = ModelCard.load(run_dir / "export" / "phase1" / "README.md")
    assert card.data.library_name == "transformers" and "bert-ds" in card.data.tags
    assert "phase1 step 4 (global step 4), 32 sequences seen, on 1 ranks" in card.text
    assert f"masked-LM accuracy {validations[-1]['val/mlm_acc']:,.4f}" in card.text
    report = write_report(run_dir).read_text()
    processes = report.split("## Processes: stops and resumes")[1].split("##")[0]
    assert "| 2 |" in processes and "| resume |" in processes, "the resume is listed (a stop, not a fault)"
    assert "| goodput | " in report and "step 1 of each process included; 0 fault(s) in the fault records, downtime " \
        "0.0 s from the failed processes' last progress to the next first steps; 0 step(s) redone) |" in report
    assert (run_dir / "report.png").is_file()
