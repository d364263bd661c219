"""PhaseTrainer in one process on a real one-rank DeepSpeed engine: what one step does and what it logs.

GPU costs made visible on a CPU: when the micro-batches of a step are read relative to its forwards, and
the values logged next to them (the lr the step trained with, the gradient norm at every ZeRO stage).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from pretrain.config.load import load_config
from pretrain.data.batches import RankBatches
from pretrain.data.loader import stream_batches
from pretrain.data.order import FEISTEL_ORDER, LEGACY_ORDER
from pretrain.schedules.lr import WarmupPolyDecay
from pretrain.trainer import PhaseState, PhaseTrainer
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, short_instances_at_64
from tests.support.trainer_fixtures import EngineRecorder, build_trainer


def test_the_next_steps_batches_are_read_while_this_steps_work_is_queued(tmp_path: Path) -> None:
    trainer = build_trainer(tmp_path, ["--phase1.gradient_accumulation_steps=4"], steps=3)
    events: list[tuple[str, int]] = []
    read = trainer.train_batches.__class__.__getitem__

    def recording_read(batches: RankBatches, k: int) -> dict[str, torch.Tensor]:
        events.append(("read", int(k)))
        return read(batches, k)

    trainer.train_batches.__class__.__getitem__ = recording_read  # type: ignore[method-assign]
    trainer.engine = EngineRecorder(trainer.engine, events)
    try:
        for _ in range(3):
            trainer.train_step()
            trainer.state.step += 1
    finally:
        trainer.train_batches.__class__.__getitem__ = read  # type: ignore[method-assign]
    kinds = "".join("r" if kind == "read" else "f" for kind, _ in events)
    # step 1 must read all four before its first forward (the loss normalisation needs its labels);
    # from then on each forward is followed by one read of the next step: the device never waits for the host
    assert kinds == "rrrr" + "fr" * 8 + "ffff", kinds
    assert [k for kind, k in events if kind == "read"] == list(range(12))  # the stream order is unchanged


def test_the_logged_lr_is_the_lr_each_step_trained_with(tmp_path: Path) -> None:
    steps = 4
    trainer = build_trainer(tmp_path, steps=steps)
    phase = load_config(str(tmp_path / "run.json")).phase1  # what the fixture's run config asks for
    schedule = WarmupPolyDecay(phase.steps, phase.warmup_fraction, phase.decay_power)
    logged = []
    for _ in range(steps):
        logged.append(trainer.train_step().values["lr"])
        trainer.state.step += 1
    expected = [phase.lr * schedule(t) for t in range(steps)]
    assert logged == pytest.approx(expected, rel=1e-12)
    assert logged[-1] > 0  # the last step trained with a non-zero lr (the old log showed the next one: 0)


def test_grad_norm_is_logged_at_every_zero_stage_and_agrees(tmp_path: Path) -> None:
    """grad_norm and grad_norm/<group> (pretrain/metrics/grad_groups.py), before clipping, at every ZeRO stage, with
    a clipping threshold far below the norm (the wrappers hand the client optimizer clipped gradients): the
    same at every stage as ZeRO-0's, whose gradients are whole on the rank, and the groups add up to the norm."""
    norms, groups = {}, {}
    for stage in (0, 1, 2, 3):
        trainer = build_trainer(tmp_path, [f"--phase1.ds_overrides.zero_optimization.stage={stage}",
                                           "--phase1.ds_overrides.gradient_clipping=1e-4"], steps=2)
        values = trainer.step_metrics(trainer.train_step())
        assert "grad_norm" in values, f"ZeRO-{stage} logs no grad_norm"
        norms[stage] = values["grad_norm"]
        groups[stage] = {tag: value for tag, value in values.items() if tag.startswith("grad_norm/")}
        assert set(groups[stage]) == {f"grad_norm/{g}" for g in ("embeddings", "layer_00", "layer_01", "head")}
        assert sum(v * v for v in groups[stage].values()) ** 0.5 == pytest.approx(norms[stage], rel=1e-5), stage
    # the same first step (same weights, batches, dropout seeds) has the same gradient at every stage
    assert norms[0] > 1e-4 and all(n == pytest.approx(norms[0], rel=1e-5) for n in norms.values()), norms
    assert all(found == pytest.approx(groups[0], rel=1e-5) for found in groups.values()), groups


def test_stream_batches_prepare_each_epoch_before_the_workers_fork(tmp_path: Path) -> None:
    """Workers read what this process would, across an epoch boundary, in either order. feistel-v1 (new runs)
    holds nothing epoch-sized; a state saved before the orders had names resumes on numpy's permutation, whose
    epoch slices this process computes before the workers fork (they inherit them)."""
    trainer = build_trainer(tmp_path, steps=2)
    batches = trainer.train_batches
    assert trainer.state.data_permutation == FEISTEL_ORDER and batches.order.name == FEISTEL_ORDER
    old_state = {key: value for key, value in trainer.state.state_dict().items() if key != "data_permutation"}
    PhaseTrainer(trainer.job, trainer.settings, trainer.engine, batches, None, trainer.throughput,
                 PhaseState.from_dict(old_state))
    assert batches.order.name == LEGACY_ORDER  # the trainer set the order its state names
    per_epoch = len(batches)
    for order in (LEGACY_ORDER, FEISTEL_ORDER):
        batches.use_order(order)
        stream = stream_batches(batches, 0, num_workers=2)
        read = [next(stream) for _ in range(per_epoch + 3)]  # across the first epoch boundary
        stream.close()
        # legacy: this process computed the epochs (the workers inherit them), not only the workers
        assert set(batches.order._slices) >= {0, 1} if order == LEGACY_ORDER else not batches.order._slices
        expected = [batches[k] for k in range(per_epoch + 3)]
        for got, want in zip(read, expected, strict=True):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k] for k in got)


def test_packed_and_unpadded_steps_train_like_padded_ones(tmp_path: Path) -> None:
    """The same instances and masks, padded, packed into fewer rows, or unpadded (real tokens only): the same
    losses step after step, updates included (why packing and unpadded attention can be defaults: they change
    the device work, not the training)."""
    shards = short_instances_at_64(build_shards(tmp_path / "short", seq_lens=(32,), train=48, val=8), tmp_path / "s64")
    no_dropout = ["--phase1.seq_len=64", "--model.overrides.hidden_dropout_prob=0.0",
                  "--model.overrides.attention_probs_dropout_prob=0.0"]
    layouts = {"padded": ["--model.attention=padded"], "packed": ["--model.attention=padded", "--phase1.packing=true"],
               "unpadded": ["--model.attention=unpadded"]}
    losses, factors = {}, {}
    for layout, keys in layouts.items():
        trainer = build_trainer(tmp_path / layout, [*no_dropout, *keys], steps=3, shards=shards)
        records = []
        for _ in range(3):
            records.append(trainer.step_metrics(trainer.train_step()))
            trainer.state.step += 1
        losses[layout] = [r[key] for r in records for key in ("loss/mlm", "loss/nsp")]
        factors[layout] = min(r["data/packing_factor"] for r in records)
    assert factors["padded"] == 1.0 and factors["packed"] > 1.5 and factors["unpadded"] >= factors["packed"]
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-4)
    assert losses["unpadded"] == pytest.approx(losses["padded"], rel=1e-4)
    assert losses["unpadded"][0] != losses["unpadded"][4]  # the weights moved in between


def test_a_recipe_step_never_synchronizes_the_device(tmp_path: Path) -> None:
    """The shipped phase-1 DeepSpeed JSON in bf16 (BF16_Optimizer, as on a GPU), 4 micro-batches per step: the
    trainer and DeepSpeed call the accelerator's synchronize() zero times per micro-batch, also from the third
    step on (where DeepSpeed's default throughput timer starts draining the device twice per micro-batch)."""
    ds = REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero1.json"
    trainer = build_trainer(tmp_path, [f"--phase1.ds_config={ds}", "--run.precision=bf16",
                                       "--phase1.gradient_accumulation_steps=4",
                                       "--phase1.ds_overrides.zero_optimization.reduce_bucket_size=4096",
                                       "--phase1.ds_overrides.zero_optimization.allgather_bucket_size=4096"], steps=5)
    assert type(trainer.engine.optimizer).__name__ == "BF16_Optimizer"
    accelerator = get_accelerator()
    calls = []
    original = accelerator.synchronize

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(trainer.state.step)
        return original(*args, **kwargs)

    accelerator.synchronize = counting  # type: ignore[method-assign]
    try:
        for _ in range(5):
            trainer.train_step()
            trainer.state.step += 1
    finally:
        accelerator.synchronize = original  # type: ignore[method-assign]
    assert calls == [], f"synchronize() during steps {sorted(set(calls))}: {len(calls)} calls in 20 micro-batches"


@pytest.mark.parametrize("minutes, saved_after", [(1e-9, [1, 2, 3]), (60.0, [3])])
def test_checkpoints_follow_the_clock_when_every_minutes_is_set(tmp_path: Path, minutes: float,
                                                                 saved_after: list[int]) -> None:
    """checkpoint.every_minutes without every_steps: a step checkpoint whenever the agreed clock says so (here
    after every step, or never before the phase end), plus the phase-end one."""
    trainer = build_trainer(tmp_path, ["--checkpoint.every_steps=null", f"--checkpoint.every_minutes={minutes}",
                                       "--checkpoint.keep_last=5", "--logging.val_every_steps=0"], steps=3)
    saved: list[int] = []
    save = trainer.save

    def recording_save(phase_end: bool = False, routine: bool = False) -> None:
        saved.append(trainer.state.step)
        save(phase_end, routine)

    trainer.save = recording_save  # type: ignore[method-assign]
    assert trainer.train() == "complete"
    assert saved == saved_after
