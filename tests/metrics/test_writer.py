"""The metrics writer: each step kept once in metrics.jsonl and TensorBoard across a stop and resume, and
the contract of its TensorBoard files: the tags docs/pretraining.md lists, read by TensorBoard's reader."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pretrain.metrics.quality import QualityPlan, QualitySection, target_tag
from pretrain.metrics.writer import MetricsWriter


def test_metrics_keep_each_step_once_across_a_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsWriter(tmp_path, enabled=True)
    for step in range(1, 8):  # checkpoint at step 4, stopped after step 7
        first.scalars(step, {"loss": float(step)})
    first.close()
    resumed = MetricsWriter(tmp_path, enabled=True)
    for step in range(5, 10):  # the resumed run repeats steps 5-7
        resumed.scalars(step, {"loss": 10.0 + step})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 10))
    assert [row["loss"] for row in rows][3:5] == [4.0, 15.0]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [step for step, _ in logged] == list(range(1, 10))
    assert logged[4] == (5, 15.0)


# --- the tags docs/pretraining.md lists against what a real step writes, read by TensorBoard's reader

DOCS = Path(__file__).resolve().parents[2] / "docs" / "pretraining.md"
# a quality mark any validation with one correct prediction reaches; the one-step tiny run's predicts none,
# so its tags are checked absent here, and their names apart (test_time_to_quality.py reads them back)
MARK = 1e-6


class RecordingWriter(MetricsWriter):
    """The real writer, keeping what the trainer hands it: the values written, to compare with the file."""

    def __init__(self, log_dir: Path, quality: QualityPlan) -> None:
        super().__init__(log_dir, enabled=True, quality=quality)
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.extra_fields = {"step", "wall_s"}  # a metrics.jsonl row's fields that are not tags
        self.histograms: dict[str, torch.Tensor] = {}

    def scalars(self, step: int, values: dict[str, float], extra: dict[str, Any] | None = None) -> None:
        self.rows.append((step, dict(values)))
        self.extra_fields |= set(extra or {})
        super().scalars(step, values, extra)

    def histogram(self, step: int, tag: str, values: torch.Tensor) -> None:
        self.histograms[tag] = values.detach().float().cpu().clone()
        super().histogram(step, tag, values)


@dataclass(frozen=True)
class DocumentedTag:
    pattern: re.Pattern[str]  # a tag, or a family (`<mark>`, `*`)
    name: str
    logged: str  # the table's `logged` cell: when the tag is there
    histogram: bool


def documented_tags() -> list[DocumentedTag]:
    """Every tag of the TensorBoard tables in docs/pretraining.md (the trainer's, and the monitors' that
    pretrain/metrics/tag_doc.py generates): backticked names of their first column, braces expanded (`a/{b,c}`),
    `<name>` and `*` standing for any one path part."""
    text = DOCS.read_text(encoding="utf-8")
    table = [row for part in text.split("| tag | logged | what |")[1:]
             for row in part.split("\n\n", 1)[0].splitlines()[2:] if row.startswith("|")]
    tags = []
    for row in table:
        first, logged = [cell.strip() for cell in row.strip("|").split("|")][:2]
        for name in re.findall(r"`([^`]+)`", first):
            head, _, rest = name.partition("{")
            choices, _, tail = rest.partition("}")
            for choice in choices.split(",") if rest else [""]:
                full = head + choice + tail
                regex = re.sub(r"<[^>]+>", "[^/]+", re.escape(full)).replace(re.escape("*"), "[^/]+")
                tags.append(DocumentedTag(re.compile(regex), full, logged, "(histogram)" in first))
    return tags


def one_logged_step(tmp_path: Path) -> tuple[Any, RecordingWriter]:
    """A one-step phase of the tiny run through the trainer's own loop (PhaseTrainer.train: the step, its
    validation, the phase-end checkpoint), logged by the real writer with the run's clock (as the driver
    builds it); few instances, one micro-batch a step, one validation batch: a fast run."""
    from tests.support.pretrain_fixtures import build_shards
    from tests.support.trainer_fixtures import build_trainer

    shards = build_shards(tmp_path / "shards", train=8, val=4)
    overrides = ["--logging.val_every_steps=1", "--logging.val_batches=1", "--model.compile=false",
                 "--phase1.gradient_accumulation_steps=1"]
    trainer = build_trainer(tmp_path / "work", overrides, steps=1, shards=shards)
    writer = RecordingWriter(tmp_path / "tb", QualityPlan(tmp_path / "run", 1, QualitySection([MARK])))
    trainer.metrics = writer
    assert trainer.train() == "complete"
    writer.close()
    return trainer, writer


def conditions_of(trainer: Any, written: dict[str, float]) -> dict[str, bool]:
    """Each `logged` value of the table: whether this run logs such a tag."""
    from pretrain.optim.lamb import ExactLamb
    from pretrain.optim.unwrap import client_optimizer

    cuda = trainer.dist_info.device.type == "cuda"
    return {
        "every step": True, "every step, NSP data": trainer.settings.nsp,
        "every step, ExactLamb": isinstance(client_optimizer(trainer.engine), ExactLamb),
        "every step, known peak": trainer.throughput.settings.peak_tflops is not None,
        "every step, CUDA": cuda, "every step, CPU": not cuda,
        "every step, compiled": False,  # --model.compile=false
        "every step, dynamic shards": not trainer.train_batches.data.manifest.static_masking,
        "validation": True, "quality mark": written["val/mlm_acc"] >= MARK, "checkpoint": True,
        "codistillation": False, "each slow-rank window's end": False,  # one rank: no peers to compare with
    }


def test_every_documented_tag_of_a_step_reads_back_from_tensorboard(tmp_path: Path) -> None:
    """What a real step writes (`one_logged_step`), read back by TensorBoard's own reader (EventAccumulator):
    each tag the table lists for this run's conditions is in the event file with the value written (as
    float32, TensorBoard's precision; the same as in metrics.jsonl's row), and each tag in the file is listed,
    so the table and the files cannot drift apart."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, writer = one_logged_step(tmp_path)
    written = {tag: value for _, values in writer.rows for tag, value in values.items()}
    conditions = conditions_of(trainer, written)
    documented = documented_tags()
    assert {tag.logged for tag in documented} <= set(conditions), "a `logged` value this test does not know"
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    scalars, histograms = events.Tags()["scalars"], events.Tags()["histograms"]
    for field in ("wall_s", "device_hours", "samples"):  # the names the writer gives a mark reached
        marks = [d for d in documented if d.logged == "quality mark"]
        assert any(d.pattern.fullmatch(target_tag(0.72, field)) for d in marks), field
    for tag in documented:
        found = [t for t in (histograms if tag.histogram else scalars) if tag.pattern.fullmatch(t)]
        assert bool(found) == conditions[tag.logged], f"{tag.name} ({tag.logged}): in the event file: {found}"
    rows = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    in_jsonl = {tag: value for row in rows for tag, value in row.items() if tag not in writer.extra_fields}
    assert set(in_jsonl) == set(scalars) and set(written) <= set(scalars)
    for tag in scalars:
        assert any(d.pattern.fullmatch(tag) and not d.histogram for d in documented), f"{tag}: not documented"
        assert events.Scalars(tag)[-1].value == np.float32(in_jsonl[tag]), tag  # as TensorBoard keeps it
        assert in_jsonl[tag] == written.get(tag, in_jsonl[tag]), tag  # the writer's own: time/*, target/*
    for tag in histograms:
        assert any(d.pattern.fullmatch(tag) and d.histogram for d in documented), f"{tag}: not documented"
        kept = events.Histograms(tag)[-1].histogram_value
        assert kept.num == writer.histograms[tag].numel()
        assert kept.sum == pytest.approx(float(writer.histograms[tag].double().sum()), rel=1e-6)
