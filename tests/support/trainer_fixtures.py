"""An in-process PhaseTrainer on a real one-rank DeepSpeed engine, built the way pretrain.train builds one.

`build_trainer(work, overrides)` plans a run over the tiny learnable shards, builds the phase's model,
engine (our schedule, the phase's DeepSpeed dict) and data exactly as `pretrain.train.run_phase` does, and
returns the trainer without running it, so a test can watch or count what one step does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pretrain.checkpointing.checkpoint import CheckpointManager
from pretrain.config.load import load_config
from pretrain.data.batches import RankBatches
from pretrain.engine import build_engine, init_distributed
from pretrain.metrics import MetricsWriter, Throughput
from pretrain.model.bert import build_model
from pretrain.model_setup import prepare_model_path
from pretrain.schedule import WarmupPolyDecay
from pretrain.stop_request import StopRequest
from pretrain.train import bert_config_from_plan, plan_run
from pretrain.trainer import PhaseState, PhaseTrainer, TrainerJob
from tests.support.pretrain_fixtures import build_shards, tiny_run_config


def build_trainer(work: Path, overrides: list[str] = (), phase: str = "phase1", steps: int = 4,
                  shards: Path | None = None) -> PhaseTrainer:
    """A trainer for `phase` of the tiny run (micro-batch 4 x accumulation 2 on one rank unless overridden),
    on `shards` or the tiny learnable ones (built once per `work` folder)."""
    if shards is None:
        shards = work / "shards"
        if not shards.exists():
            build_shards(shards)
    work.mkdir(parents=True, exist_ok=True)
    run_json = tiny_run_config(work / "run.json", shards, work / "run", phase1=steps, phase2=steps)
    config = load_config(str(run_json), ["--logging.tensorboard=false", *overrides])
    dist_info = init_distributed()
    plan = plan_run(config, dist_info, verify_checksums=False)
    settings = config.phase(phase)
    torch.manual_seed(config.run.seed)
    model = build_model(bert_config_from_plan(plan))
    prepare_model_path(model, config, phase, plan.ds_configs[phase], dist_info.device)  # as run_phase: compiles
    schedule = WarmupPolyDecay(settings.steps, settings.warmup_fraction, settings.decay_power)
    engine = build_engine(model, plan.ds_configs[phase], lr_schedule=schedule)
    micro = engine.train_micro_batch_size_per_gpu()
    data = plan.data[phase]
    unpadded = config.model.attention == "unpadded"  # the layout the driver's run_phase picks
    train_batches = RankBatches(data, "train", config.run.seed, 0, 1, micro, packing=settings.packing, unpadded=unpadded)
    val_batches = RankBatches(data, "val", config.run.seed, 0, 1, micro, shuffle=False, unpadded=unpadded)
    job = TrainerJob(config, plan.resolved, dist_info, CheckpointManager(work / "ckpt", 1, 0),
                     MetricsWriter(None, False), StopRequest())
    return PhaseTrainer(job, engine, train_batches, val_batches, Throughput(1.0, settings.seq_len, 1, None),
                        PhaseState(phase))


class EngineRecorder:
    """Passes every call through to the engine and appends ("forward", n) to a shared event list."""

    def __init__(self, engine: Any, events: list[tuple[str, int]]) -> None:
        self._engine, self._events, self._forwards = engine, events, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._events.append(("forward", self._forwards))
        self._forwards += 1
        return self._engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
