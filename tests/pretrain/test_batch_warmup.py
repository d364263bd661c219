"""The batch warmup (pretrain/schedules/batch.py) on a real one-rank DeepSpeed engine: which backward is
DeepSpeed's accumulation boundary, the samples of every optimizer step, the data stream read in order, the first
(smallest) step against a run built with that batch, and an exact resume from a checkpoint in the middle of the ramp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.checkpointing.checkpoint import CheckpointManager
from pretrain.config.load import load_config
from pretrain.data.batches import RankBatches
from pretrain.distributed.process_group import init_distributed
from pretrain.distributed.stop_request import StopRequest
from pretrain.errors import ConfigError
from pretrain.loop_sections import LoopPhaseSection
from pretrain.metrics.writer import MetricsWriter
from pretrain.phase_state import LoopPlan, PhaseState, settle_batch_ramp
from pretrain.plan.run_plan import plan_run
from pretrain.schedules.batch import BatchRamp, BatchWarmupSettings, build_batch_ramp
from pretrain.schedules.clock import PhaseClock
from pretrain.schedules.phase import PhaseSchedules
from pretrain.train import PhaseStart, build_phase
from pretrain.trainer import PhaseTrainer, TrainerJob
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

# accumulation 4 on one rank (micro-batch 4: 16 samples a step), the batch from 1/4 over the first 3 steps
RAMP = ["--phase1.gradient_accumulation_steps=4", "--phase1.batch_warmup_steps=3", "--phase1.batch_warmup_start=0.25",
        "--model.overrides.hidden_dropout_prob=0.0", "--model.overrides.attention_probs_dropout_prob=0.0"]
STEPS = 6


def trainer_for(work: Path, shards: Path, overrides: list[str], resume_tag: str | None = None) -> PhaseTrainer:
    """Phase 1 of the tiny run built as the driver builds it, its checkpoints in `work`/ckpt (resumed from
    `resume_tag` when given)."""
    work.mkdir(parents=True, exist_ok=True)
    run_json = tiny_run_config(work / "run.json", shards, work / "run", phase1=STEPS)
    config = load_config(str(run_json), ["--logging.tensorboard=false", "--logging.progress_bar=false", *overrides])
    dist_info = init_distributed()
    plan = plan_run(config, dist_info, verify_checksums=False)
    job = TrainerJob(Path(config.run.dir), plan.resolved, dist_info, CheckpointManager(work / "ckpt", 2, 0),
                     MetricsWriter(None, False), StopRequest())
    return build_phase(plan.phases["phase1"], job, PhaseStart(resume_tag=resume_tag))


class BoundaryTrace:
    """Passes every call to the engine and writes, per backward, whether DeepSpeed took it as the accumulation
    boundary ('B') or not ('.'), and '|' when an optimizer step was taken."""

    def __init__(self, engine: Any) -> None:
        self._engine, self.trace = engine, ""

    def backward(self, loss: torch.Tensor) -> Any:
        self.trace += "B" if self._engine.is_gradient_accumulation_boundary() else "."
        return self._engine.backward(loss)

    def step(self) -> Any:
        before = self._engine.global_steps
        out = self._engine.step()
        if self._engine.global_steps != before:
            self.trace += "|"
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_the_batch_grows_step_by_step_with_deepspeeds_boundary_on_each_steps_last_backward(tmp_path: Path) -> None:
    shards = build_shards(tmp_path / "shards")
    trainer = trainer_for(tmp_path / "a", shards, RAMP)
    reads: list[int] = []
    read = RankBatches.__getitem__

    def recording_read(batches: RankBatches, k: int) -> dict[str, torch.Tensor]:
        reads.append(int(k))
        return read(batches, k)

    trace = BoundaryTrace(trainer.engine)
    trainer.engine = trace
    RankBatches.__getitem__ = recording_read  # type: ignore[method-assign]
    samples, logged = [], []
    try:
        for _ in range(STEPS):
            before = trainer.state.data_position
            values = trainer.step_metrics(trainer.train_step())
            trainer.state.step += 1
            samples.append(trainer.state.data_position - before)
            logged.append(values["schedule/batch_size"])
    finally:
        RankBatches.__getitem__ = read  # type: ignore[method-assign]
    assert samples == [4, 8, 12, 16, 16, 16] and logged == samples  # 1, 2, 3, then 4 micro-batches of 4
    assert trace.trace == "B|.B|..B|...B|...B|...B|", trace.trace  # the boundary is each step's last backward
    assert trace.global_steps == STEPS and trace.global_samples == sum(samples)
    assert reads == list(range(sum(samples) // 4))  # the stream read once, in order, nothing skipped
    assert trainer.settings.schedules.clock.samples_before(STEPS) == sum(samples)
    recorded = trainer.resolved_config["resolved"]["schedules"]["phase1"]  # what the report and the card print
    assert recorded.endswith("; batch warmup: 4 of 16 sequences at the first step, the full batch from step 3"), \
        recorded  # in sequences of all ranks: the same words on any number of ranks


def test_the_first_step_of_a_ramp_trains_like_a_run_of_that_batch(tmp_path: Path) -> None:
    """Step 0 of the ramp (1 micro-batch of 4) against a run built with accumulation 1: the same loss and the same
    weights after the update, to float precision; DeepSpeed divides the loss by the step's accumulation, not the
    engine's."""
    shards = build_shards(tmp_path / "shards")
    ramped = trainer_for(tmp_path / "a", shards, RAMP)
    plain = trainer_for(tmp_path / "b", shards, [*RAMP[3:], "--phase1.gradient_accumulation_steps=1"])
    losses = [t.train_step().values["loss/mlm"] for t in (ramped, plain)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    weights = [torch.cat([p.detach().flatten() for p in t.engine.module.parameters()]) for t in (ramped, plain)]
    assert torch.allclose(weights[0], weights[1], rtol=1e-5, atol=1e-7)


def test_a_resume_in_the_middle_of_the_ramp_continues_exactly(tmp_path: Path) -> None:
    """2 steps, a checkpoint (mid-ramp: the next step takes 3 of 4 micro-batches), a new process's trainer resumed
    from it: steps 3-6 give the uninterrupted run's losses bit for bit."""
    shards = build_shards(tmp_path / "shards")
    reference = trainer_for(tmp_path / "ref", shards, RAMP)
    expected = []
    for _ in range(STEPS):
        expected.append(reference.train_step().values["loss/mlm"])
        reference.state.step += 1
    first = trainer_for(tmp_path / "run", shards, RAMP)
    for _ in range(2):
        first.train_step()
        first.state.step += 1
    first.save()
    resumed = trainer_for(tmp_path / "run", shards, RAMP, resume_tag="phase1-step0000002")
    assert (resumed.state.step, resumed.state.data_position, resumed.accumulation) == (2, 12, 3)
    got = []
    for _ in range(STEPS - 2):
        got.append(resumed.train_step().values["loss/mlm"])
        resumed.state.step += 1
    assert got == expected[2:]


def test_a_ramp_in_tokens_covers_the_fewest_steps_that_hold_them_and_another_world_is_refused(tmp_path: Path) -> None:
    """batch_warmup_tokens=1,600 at seq 32 (50 sequences; micro-batches of 4): the plan's clock takes the fewest
    ramp steps whose batches hold 1,600 tokens (a ramp one step shorter, reshaped, holds fewer). A trainer whose
    data position is not where this world's ramp puts its step (a checkpoint of another number of ranks) is
    refused in one line before any step."""
    shards = build_shards(tmp_path / "shards")
    tokens = [*RAMP[:1], *RAMP[3:], "--phase1.batch_warmup_tokens=1600"]
    trainer = trainer_for(tmp_path / "a", shards, tokens)
    clock = trainer.settings.schedules.clock
    ramp_steps = clock.ramp.steps
    assert clock.samples_before(ramp_steps) * 32 >= 1600  # the ramp's steps hold the tokens asked for ...
    shorter = build_batch_ramp(BatchWarmupSettings(ramp_steps - 1, 0.25), 4)
    assert sum(4 * shorter.accumulation_at(s) for s in range(ramp_steps - 1)) * 32 < 1600  # ... one step fewer not
    trainer.state.step, trainer.state.data_position = 1, 8  # step 1 starts at sample 4 under this phase's ramp
    with pytest.raises(ConfigError, match=r"^phase1\.batch_warmup_steps: the checkpoint is at sample 8 of phase1, but "
                                          r"the batch warmup puts step 1 at 4 \(a checkpoint written before"):
        settle_batch_ramp(trainer.settings, trainer.state, trainer.round_samples)


def test_a_resume_in_micro_batch_rounds_of_another_size_keeps_the_warmup_the_phase_started_with(tmp_path: Path) -> None:
    """What another number of ranks changes for a warmup is the size of a micro-batch round (micro-batch x ranks),
    in which the ramp counts. Here one rank resumes with micro-batches of 2 (rounds of 2 samples) a phase begun in
    rounds of 4: over 4 ramp steps its own ramp would take 4, 8, 10, 14 samples (2, 4, 5, 7 rounds) where the phase
    took 4, 8, 12, 12 (1, 2, 3, 3). It keeps the phase's ramp, recorded in the checkpoint: step 2 takes 12 samples
    as 6 micro-batches, and steps 2-5 give the uninterrupted run's batches and, to float rounding, its losses."""
    ramp4 = ["--phase1.gradient_accumulation_steps=4", "--phase1.batch_warmup_steps=4", *RAMP[2:]]
    halves = ["--phase1.micro_batch_size=2", "--phase1.gradient_accumulation_steps=8"]
    shards = build_shards(tmp_path / "shards")
    reference = trainer_for(tmp_path / "ref", shards, ramp4)
    expected = []
    for _ in range(STEPS):
        values = reference.train_step().values
        expected.append((values["schedule/batch_size"], values["loss/mlm"]))
        reference.state.step += 1
    assert [batch for batch, _ in expected] == [4, 8, 12, 12, 16, 16]
    own = PhaseClock(STEPS, 16, 32, build_batch_ramp(BatchWarmupSettings(4, 0.25), 8))
    assert [own.batch_at(s) for s in range(4)] == [4, 8, 10, 14]  # what the new rounds' own ramp would take
    first = trainer_for(tmp_path / "run", shards, ramp4)
    for _ in range(2):
        first.train_step()
        first.state.step += 1
    first.save()
    resumed = trainer_for(tmp_path / "run", shards, [*ramp4, *halves], resume_tag="phase1-step0000002")
    assert resumed.state.batch_ramp == {"accumulation": 4, "steps": 4, "start": 0.25}
    assert (resumed.state.data_position, resumed.round_samples, resumed.accumulation) == (12, 2, 6)
    got = []
    for _ in range(STEPS - 2):
        values = resumed.train_step().values
        got.append((values["schedule/batch_size"], values["loss/mlm"]))
        resumed.state.step += 1
    assert [batch for batch, _ in got] == [batch for batch, _ in expected[2:]]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in expected[2:]], rel=1e-5)


def test_a_warmup_step_that_does_not_split_into_this_worlds_rounds_is_refused_in_one_line() -> None:
    """A phase begun on 2 ranks of micro-batch 4 (rounds of 8: its ramp takes 8, 16, 24, 24 samples, then 32)
    resumes after step 2 on 1 rank (rounds of 4) with that ramp; on 4 ranks (rounds of 16) sample 24 is not where a
    round starts (a rank cannot take part of a micro-batch, and every rank of a step takes as many as the others),
    so it is refused before any step, and past the ramp too while the position is not whole rounds."""
    started = BatchRamp(4, 4, 0.25)

    def world(round_samples: int) -> LoopPlan:
        ramp = build_batch_ramp(BatchWarmupSettings(4, 0.25), 32 // round_samples)
        return LoopPlan("phase1", LoopPhaseSection(8), schedules=PhaseSchedules(PhaseClock(8, 32, 32, ramp)))

    one_rank = settle_batch_ramp(world(4), PhaseState("phase1", 2, 24, batch_ramp=started.record()), 4)
    assert [one_rank.schedules.clock.batch_at(s) for s in range(6)] == [8, 16, 24, 24, 32, 32]
    assert [one_rank.schedules.clock.rounds_at(s, 4) for s in range(6)] == [2, 4, 6, 6, 8, 8]
    for step, position, why in ((2, 24, "step 2 starts at sample 24"), (4, 72, "step 4 starts at sample 72"),
                                (1, 8, "step 1 starts at sample 8")):
        with pytest.raises(ConfigError, match=rf"^phase1\.batch_warmup_steps: {why} under the warmup phase1 started "
                                              r"with \(rounds of 8 samples\), not whole micro-batch rounds of this "
                                              r"world \(16 samples: micro-batch x ranks\); resume on"):
            settle_batch_ramp(world(16), PhaseState("phase1", step, position, batch_ramp=started.record()), 16)
    odd = PhaseClock(8, 32, 32, BatchRamp(4, 4, 0.25))
    assert odd.first_misfit(0, 0, 16) == "step 0 takes 8 samples"
    fresh = PhaseState("phase1")
    settle_batch_ramp(world(16), fresh, 16)  # a phase that starts here records its own ramp
    assert fresh.batch_ramp == {"accumulation": 2, "steps": 4, "start": 0.25}


def test_bad_ramp_keys_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^phase1\.batch_warmup_steps: must be an integer >= 0, got -1$"):
        build_batch_ramp(BatchWarmupSettings(-1), 4, "phase1.")
    with pytest.raises(ConfigError, match=r"^phase2\.batch_warmup_start: must be in \(0, 1\], got 0.0$"):
        build_batch_ramp(BatchWarmupSettings(3, 0.0), 4, "phase2.")
    with pytest.raises(ConfigError, match=r"^phase1\.batch_warmup_tokens: set it or batch_warmup_steps \(3\), not both$"):
        build_batch_ramp(BatchWarmupSettings(3, 0.25, 1000), 4, "phase1.", 128)
    assert build_batch_ramp(BatchWarmupSettings(), 4) is None
