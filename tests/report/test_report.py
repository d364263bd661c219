"""`./launch.sh report` on a run folder laid out as the demo leaves it (tests/support/report_fixtures.py):
report.md with its time-to-target table (parsed back), report.png, the fine-tune results that belong to the
run, and the model card regenerated with them and read by huggingface_hub's own parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.report import write as report
from tests.support.paths import REPO_ROOT
from tests.support.report_fixtures import GLUE_MEDIAN, RANKS, SQUAD_SCORES, build_demo_like_run

PRICE = 2.5


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = build_demo_like_run(tmp_path_factory.mktemp("report") / "out")
    assert report.main([str(run_dir), "--usd-per-device-hour", str(PRICE)]) == 0
    return run_dir


def section(markdown: str, title: str) -> list[str]:
    """The lines of one '## title' section."""
    lines = markdown.splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def table(lines: list[str]) -> list[dict[str, str]]:
    """The first markdown table in `lines` as dicts keyed by its header."""
    rows = [line for line in lines if line.startswith("|")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    return [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]


def test_the_report_has_the_time_to_target_table_of_the_logged_rows(reported: Path) -> None:
    markdown = (reported / "report.md").read_text()
    targets = {row["val/mlm_acc target"]: row for row in table(section(markdown, "Time to target"))}
    assert list(targets) == ["0.3", "0.5", "0.65", "0.72"], "the config's logging.quality_targets"
    logged = metrics_rows(reported)
    for mark, step in (("0.3", 4), ("0.5", 6), ("0.65", 10)):
        row = next(r for r in logged if r["step"] == step and "val/mlm_acc" in r)
        assert row[f"target/mlm_acc_{mark}/wall_s"] == row["time/wall_s"], "the driver marked it on this row"
        cells = targets[mark]
        assert cells["reached at step"] == str(step) and float(cells["val/mlm_acc"]) == pytest.approx(row["val/mlm_acc"])
        assert cells["samples"] == f"{row['time/samples']:,.0f}"
        assert float(cells["device-hours"]) == pytest.approx(row["time/device_hours"], abs=1e-4)
        assert float(cells["cost (USD)"]) == pytest.approx(row["time/device_hours"] * PRICE, abs=0.01)
        assert cells["wall-clock"] == f"{row['time/wall_s'] / 3600:.2f} h"
    # Step 10 came from the resumed process: its clock adds the first process's 5 h (and its ranks x hours).
    assert float(targets["0.65"]["device-hours"]) > RANKS * 5.0 + RANKS * 5.0 - 0.01
    assert targets["0.72"]["reached at step"] == "not reached (best 0.700 at step 10)"


def test_the_report_shows_resumes_results_config_and_the_picture(reported: Path) -> None:
    markdown = (reported / "report.md").read_text()
    processes = table(section(markdown, "Processes: stops and resumes"))
    assert [(p["steps logged"], p[""]) for p in processes] == [("1 - 6", "start"), ("5 - 10", "resume")]
    results = table(section(markdown, "Fine-tune results"))
    found = {(r["benchmark"], r["task"], r["metric"], r["notes"]): r["value"] for r in results}
    assert found[("SQuAD v1.1", "squad", "f1", "")] == "7.25"
    assert found[("SQuAD v1.1", "squad", "exact_match", "fine-tuned from random weights (baseline)")] == "0.50"
    assert found[("GLUE", "mrpc", "f1", "median of 2 seeds")] == "81.25"
    assert len(found) == 6, "another run's fine-tune (F1 99) is not this run's"
    config = section(markdown, "Config")
    assert any(line.startswith("| phase1 | 32 |") for line in config) and "```json" in config
    recipe = {row["phase"]: row for row in table(config)}
    assert recipe["phase1"]["lr schedule"].startswith("warmup-poly: linear warmup over "), recipe  # the plan's record
    assert json.loads(markdown.split("```json\n")[1].split("\n```")[0])["run"]["dir"] == str(reported)
    assert "![loss, accuracy, throughput and MFU](report.png)" in markdown
    assert (reported / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_model_card_is_regenerated_with_the_results_and_parses(reported: Path) -> None:
    from huggingface_hub import ModelCard

    card = ModelCard.load(reported.parent / "model" / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "fill-mask"
    assert {"bert", "bert-ds", "fill-mask"} <= set(card.data.tags)
    scores = {(r.dataset_type, r.dataset_config, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert scores == {("squad", None, "exact_match"): SQUAD_SCORES["exact_match"], ("squad", None, "f1"): 7.25,
                      ("glue", "mrpc", "f1"): GLUE_MEDIAN["f1"], ("glue", "mrpc", "accuracy"): GLUE_MEDIAN["accuracy"]}
    text = card.text
    for heading in ("## Architecture", "## Vocabulary", "## Data", "## Recipe and steps", "## Validation",
                    "## Fine-tuning results", "## How to load it"):
        assert heading in text, heading
    assert "At step 10 on the held-out shards: masked-LM loss 2.5000, masked-LM accuracy 0.7000" in text
    assert "phase2 step 4 (global step 10)" in text and "48 tokens" in text
    assert "| warmup-poly: linear warmup over " in text  # the lr schedule the plan resolved, in words
    assert f'AutoModelForMaskedLM.from_pretrained("{reported.parent / "model"}")' in text


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(tmp_path / "absent")]) == 2
    assert report.main([str(tmp_path)]) == 2
    (tmp_path / "config.resolved.json").write_text("{}")
    assert report.main([str(tmp_path), "--usd-per-device-hour", "-1"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(line.startswith("report: ") for line in errors), errors
    assert "no run folder" in errors[1] and "a price must be >= 0" in errors[2]


def test_help_imports_nothing_heavy() -> None:
    code = ("import runpy, sys\nsys.argv = ['pretrain.report.write', '--help']\ntry:\n"
            "    runpy.run_module('pretrain.report.write', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'matplotlib', 'transformers', 'huggingface_hub') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--usd-per-device-hour" in proc.stdout and proc.stdout.strip().endswith("[]"), proc.stdout
