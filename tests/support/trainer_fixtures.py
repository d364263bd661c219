"""An in-process PhaseTrainer on a real one-rank DeepSpeed engine, built the way pretrain.train builds one.

`build_trainer(work, overrides)` plans a run over the tiny learnable shards, builds the phase's model,
engine (our schedule, the phase's DeepSpeed dict) and data with the driver's own `pretrain.train.build_phase`, and
returns the trainer without running it, so a test can watch or count what one step does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.checkpointing.checkpoint import CheckpointManager
from pretrain.config.load import load_config
from pretrain.distributed.process_group import init_distributed
from pretrain.distributed.stop_request import StopRequest
from pretrain.metrics.writer import MetricsWriter
from pretrain.plan.run_plan import plan_run
from pretrain.train import PhaseStart, build_phase
from pretrain.trainer import PhaseTrainer, TrainerJob
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
    config = load_config(str(run_json), ["--logging.tensorboard=false", "--logging.progress_bar=false", *overrides])
    dist_info = init_distributed()
    plan = plan_run(config, dist_info, verify_checksums=False)
    job = TrainerJob(Path(config.run.dir), plan.resolved, dist_info, CheckpointManager(work / "ckpt", 1, 0),
                     MetricsWriter(None, False), StopRequest())
    return build_phase(plan.phases[phase], job, PhaseStart())


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
