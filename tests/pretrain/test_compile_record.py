"""A compile fallback is a fact of the whole run: config.resolved.json, and the run config every later checkpoint
carries, say that the layer runs eager and why (pretrain/train.py `record_compile_fallback`, the process's
CompileLedger's `on_fallback`)."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.checkpointing.checkpoint import CheckpointManager
from pretrain.distributed.process_group import init_distributed
from pretrain.distributed.stop_request import StopRequest
from pretrain.metrics.writer import MetricsWriter
from pretrain.run_folder import RESOLVED_CONFIG
from pretrain.train import record_compile_fallback
from pretrain.trainer import TrainerJob


def test_a_fallback_rewrites_the_resolved_config_in_place_on_rank_0(tmp_path: Path) -> None:
    resolved = {"model": {"compile": None}, "resolved": {"world_size": 1, "attention": {
        "phase1": {"path": "unpadded", "compile": True, "why": "auto"},
        "phase2": {"path": "unpadded", "compile": True, "why": "auto"}}}}
    job = TrainerJob(tmp_path, resolved, init_distributed(), CheckpointManager(tmp_path / "ckpt", 1, 0),
                     MetricsWriter(None, False), StopRequest())
    held_by_the_trainer = job.resolved_config
    record_compile_fallback(job, "BackendCompilerFailed: planted")
    written = json.loads((tmp_path / RESOLVED_CONFIG).read_text(encoding="utf-8"))
    assert written == held_by_the_trainer  # the next checkpoint's run config says the same
    for phase in ("phase1", "phase2"):
        entry = written["resolved"]["attention"][phase]
        assert entry["compile"] is False and entry["path"] == "unpadded"
        assert entry["compile_why"] == "the encoder layer runs eager: BackendCompilerFailed: planted"
    assert written["model"] == {"compile": None}  # what the user asked stays as asked
