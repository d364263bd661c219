"""Checkpoints load as data (pretrain/checkpointing/safe_load.py): a checkpoint someone hands you cannot run code.

Real checkpoints, written by the toolkit's own trainer on real one-rank DeepSpeed engines at every precision and
ZeRO stage the shipped recipes and fine-tunes run, load with `weights_only=True` and the allowlist, and the
allowlist holds nothing they do not need. Then a planted `__reduce__` (it would create a marker file) in each
kind of checkpoint file is refused on each path that reads it (export, `init_from`, resume, the conversion to
another world size) in one line naming the file and the global, and the marker never appears. A checkpoint
whose RNG file is the previous release's pickle still resumes, to the same random draws.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import pickle
import random
import shlex
import shutil
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import pytest
import torch

from pretrain.checkpointing.checkpoint import CheckpointManager, consolidated_state_dict
from pretrain.checkpointing.elastic import FORMAT as ELASTIC_FORMAT
from pretrain.checkpointing.elastic import prepare_resume
from pretrain.checkpointing.layout import CONSOLIDATED, MANIFEST, RUN_CONFIG, make_tag
from pretrain.checkpointing.safe_load import UnsafeCheckpointError, allowed_globals, load_data
from pretrain.checkpointing.weights_source import VocabIdentity, initial_weights
from pretrain.errors import USER_ERROR_EXIT, ConfigError, ResumeError
from pretrain.export import main as export_main
from pretrain.train import main as train_main
from tests.support.pretrain_fixtures import build_shards, tiny_run_config
from tests.support.trainer_fixtures import build_trainer

STAGE = "--phase1.ds_overrides.zero_optimization.stage="
# (name, overrides): the ZeRO stage and precision of every shipped DeepSpeed JSON under run.precision=auto on CPU
# (fp32) and on GPUs (bf16, else fp16); lamb_zero1.json's fp32 gradient accumulation makes bf16 BF16_Optimizer.
# The fine-tunes run ZeRO-0 fp32 on one rank (pretrain/finetune/common.py).
SHIPPED = {
    "zero0-fp32": [f"{STAGE}0"],
    "zero1-fp32": [f"{STAGE}1"],
    "zero1-bf16-BF16_Optimizer": [f"{STAGE}1", "--run.precision=bf16",
                                  "--phase1.ds_overrides.data_types.grad_accum_dtype=fp32"],
    "zero1-fp16": [f"{STAGE}1", "--run.precision=fp16"],
    "zero2-fp32": [f"{STAGE}2"],
    "zero2-bf16": [f"{STAGE}2", "--run.precision=bf16"],
    "zero2-fp16": [f"{STAGE}2", "--run.precision=fp16"],
    "zero3-fp32": [f"{STAGE}3"],  # no shipped JSON asks for it; elastic resume supports it
}


def module_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The module's weights as fp32 copies (ZeRO-3's gathered from their partitions first)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


class Saved:
    """One real checkpoint: its trainer (engine alive), folder, tag and the fp32 weights it holds."""

    def __init__(self, work: Path, overrides: list[str]) -> None:
        self.trainer = build_trainer(work, ["--model.compile=false", *overrides], steps=2)
        self.trainer.train_step()
        self.trainer.save()
        self.step = self.trainer.state.step
        self.root, self.tag = self.trainer.checkpoints.root, make_tag("phase1", self.step)
        self.weights = module_weights(self.trainer.engine)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Saved]:
    work = tmp_path_factory.mktemp("shipped")
    shards = work / "shards"
    saved = {}
    for name, overrides in SHIPPED.items():
        (work / name).mkdir()
        if shards.exists():
            (work / name / "shards").symlink_to(shards)
        saved[name] = Saved(work / name, overrides)
        shards = work / name / "shards"
    return saved


def test_every_shipped_precision_and_zero_stage_saves_and_loads_as_data(shipped: dict[str, Saved]) -> None:
    needed: set[str] = set()
    for name, saved in shipped.items():
        files = sorted((saved.root / saved.tag).glob("*.pt"))
        assert len(files) >= 2, (name, files)  # model states and RNG at least; ZeRO adds the partitions
        for file in files:
            needed.update(torch.serialization.get_unsafe_globals_in_checkpoint(file))
            assert isinstance(load_data(file), dict), file
        # consolidation (export, init_from) reads the fp32 masters: the module's weights, to its precision
        merged = consolidated_state_dict(saved.root, saved.tag)
        for key, weight in saved.weights.items():
            tolerance = 1e-2 if "fp32" not in name else 0.0
            assert torch.allclose(merged[key], weight, atol=tolerance, rtol=tolerance), (name, key)
        # resume: DeepSpeed's own loads go through our checkpoint engine wrapper; one more step moved the weights
        engine = saved.trainer.engine
        saved.trainer.train_step()
        assert any(not torch.equal(w, saved.weights[n]) for n, w in module_weights(engine).items()), name
        state = saved.trainer.checkpoints.load(engine, saved.tag)
        assert state["step"] == saved.step
        for n, w in module_weights(engine).items():
            assert torch.equal(w, saved.weights[n]), (name, n)
    # the allowlist is exactly what these checkpoints need: classes only, none to spare
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in allowed_globals()}
    assert needed == allowed and all(isinstance(c, type) for c in allowed_globals()), (needed, allowed)


# ---------------------------------------------------------------------- planted code
class Planted:
    """An object whose unpickling runs a command (the review's demonstration): it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant_in_torch_file(file: Path, marker: Path) -> None:
    state = load_data(file)
    state["planted"] = Planted(marker)
    torch.save(state, file)


def plant_in_old_rng(file: Path, marker: Path) -> None:
    """The previous release's pickled RNG dict, with one more entry."""
    old = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
           "planted": Planted(marker)}
    file.write_bytes(pickle.dumps(old))


class NestedStorage:
    """A tensor's bytes as pickle carries them (torch.storage._load_from_bytes, a nested torch.save file), with
    the nested file holding the planted object: today's pickle.loads hands it to torch.load(weights_only=False)."""

    def __init__(self, marker: Path) -> None:
        buffer = io.BytesIO()
        torch.save(Planted(marker), buffer, _use_new_zipfile_serialization=False)
        self.nested = buffer.getvalue()

    def __reduce__(self) -> tuple[Any, ...]:
        return torch.storage._load_from_bytes, (self.nested,)


def plant_in_rng_bytes(file: Path, marker: Path) -> None:
    file.write_bytes(pickle.dumps({"torch": NestedStorage(marker), "numpy": np.random.get_state(),
                                   "python": random.getstate()}))


def plant_elastic_state(file: Path, marker: Path) -> None:
    """An `elastic_state.pt` (reused as it is by a resume on another world size) holding the planted object; the
    run config then says the checkpoint was written by 2 ranks, so the resume reads it."""
    torch.save({"format": ELASTIC_FORMAT, "planted": Planted(marker)}, file)
    config = json.loads((file.parent / RUN_CONFIG).read_text())
    config["resolved"]["world_size"] = 2
    (file.parent / RUN_CONFIG).write_text(json.dumps(config))


def model_states(folder: Path) -> Path:
    return folder / "mp_rank_00_model_states.pt"


def optimizer_states(folder: Path) -> Path:
    return next(folder.glob("*optim_states.pt"))


KINDS = {
    "model states": (model_states, plant_in_torch_file),
    "optimizer states": (optimizer_states, plant_in_torch_file),
    "RNG": (lambda folder: folder / "rng_rank00000.pt", plant_in_torch_file),
    "RNG, previous release's pickle": (lambda folder: folder / "rng_rank00000.pt", plant_in_old_rng),
    "RNG, a tensor's nested bytes": (lambda folder: folder / "rng_rank00000.pt", plant_in_rng_bytes),
    "elastic state": (lambda folder: folder / CONSOLIDATED, plant_elastic_state),
}


@pytest.fixture
def handed(shipped: dict[str, Saved], tmp_path: Path) -> Saved:
    """A copy of the tiny_cpu recipe's checkpoint (ZeRO-2 fp32), the one a test plants code in."""
    saved = copy.copy(shipped["zero2-fp32"])
    shutil.copytree(saved.root, tmp_path / "handed")
    saved.root = tmp_path / "handed"
    return saved


def plant(saved: Saved, kind: str, marker: Path) -> Path:
    locate, planter = KINDS[kind]
    file = locate(saved.root / saved.tag)
    planter(file, marker)
    return file


def assert_one_line_naming(text: str, file: Path) -> None:
    assert "\n" not in text.strip() and str(file) in text and "posix.system" in text, text


@pytest.mark.parametrize("kind", ["model states", "optimizer states"])
def test_export_refuses_planted_code_in_one_line(handed: Saved, kind: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "marker"
    file = plant(handed, kind, marker)
    assert export_main([str(handed.root), str(tmp_path / "out")]) == 2
    assert_one_line_naming(capsys.readouterr().err, file)
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["model states", "optimizer states"])
def test_init_from_refuses_planted_code_in_one_line(handed: Saved, kind: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    file = plant(handed, kind, marker)
    vocab = VocabIdentity.of(handed.trainer.resolved_config["resolved"])
    with pytest.raises(ConfigError) as refused:
        initial_weights(str(handed.root), vocab, "phase2.init_from")
    assert refused.value.line().startswith("config error: phase2.init_from: ")
    assert_one_line_naming(refused.value.line(), file)
    assert not marker.exists()


@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_refuses_planted_code_in_one_line(handed: Saved, kind: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    file = plant(handed, kind, marker)
    with pytest.raises(UnsafeCheckpointError) as refused:
        CheckpointManager(handed.root, 1, 0).load(handed.trainer.engine, handed.tag)
    assert refused.value.line().startswith("checkpoint error: ")
    assert_one_line_naming(refused.value.line(), file)
    assert not marker.exists()


def test_conversion_to_another_world_size_refuses_planted_code(handed: Saved, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    file = plant(handed, "optimizer states", marker)
    ds_configs = handed.trainer.resolved_config["resolved"]["ds_configs"]
    with pytest.raises(ResumeError) as refused:  # rank 0 converts the 1-rank checkpoint for a job of 2
        prepare_resume(handed.root, handed.tag, ds_configs, rank=0, world_size=2)
    assert_one_line_naming(str(refused.value), file)
    assert not marker.exists() and not (file.parent / CONSOLIDATED).exists()


def test_a_checkpoint_of_the_previous_release_still_resumes(handed: Saved) -> None:
    """Its RNG file is a bare pickle of the runtime's own types: read without unpickling anything else."""
    torch.manual_seed(11), np.random.seed(12), random.seed(13)
    np.random.randn(), random.gauss(0.0, 1.0)  # a cached Gaussian in both
    old = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    expected = draws()
    (handed.root / handed.tag / "rng_rank00000.pt").write_bytes(pickle.dumps(old))
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    CheckpointManager(handed.root, 1, 0).load(handed.trainer.engine, handed.tag)
    assert draws() == expected


def test_the_driver_refuses_a_planted_checkpoint_in_one_line_and_exits_2(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The whole resume as a user runs it (`python -m pretrain.train`, here in this process): a run stopped at step 2
    of 4, its model states given a planted object and its manifest rewritten to match (a sha256 is no signature:
    whoever hands over a checkpoint writes its manifest too). The rerun stops before training: one line, exit 2."""
    shards = build_shards(tmp_path / "shards", seq_lens=(32,), train=32, val=8)
    command = ["--config", str(tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")),
               '--run.phases=["phase1"]', "--phase1.steps=4", "--logging.val_every_steps=0",
               "--logging.tensorboard=false", "--model.compile=false"]
    assert train_main([*command, "--run.stop_after_steps=2"]) == 0
    folder = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest").read_text()
    marker = tmp_path / "marker"
    file = model_states(folder)
    plant_in_torch_file(file, marker)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][file.name].update(size=file.stat().st_size, sha256=hashlib.sha256(file.read_bytes()).hexdigest())
    (folder / MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    assert train_main(command) == USER_ERROR_EXIT
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("checkpoint error: "), lines
    assert_one_line_naming(lines[0], file)
    assert not marker.exists()


def draws() -> tuple[Any, ...]:
    return (torch.rand(4).tolist(), np.random.rand(4).tolist(), np.random.randn(), random.random(),
            random.gauss(0.0, 1.0))
