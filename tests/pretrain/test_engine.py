"""pretrain.engine in a plain single process (no launcher): real DeepSpeed engines, world size 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import deepspeed
import pytest
import torch
from torch import nn

from pretrain.distributed.cluster import device_index
from pretrain.distributed.info import DistInfo
from pretrain.distributed.process_group import init_distributed, process_group_backend
from pretrain.engine import build_engine
from pretrain.optim.lamb import ExactLamb, UnboundZeroLayoutError, bind_zero_layout
from pretrain.optim.unwrap import client_optimizer
from pretrain.optim.zero_layout import ZeroLayout
from tests.support.launching import deepspeed_cpu_env, free_port
from tests.support.paths import SCRIPTS
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

PROBE = SCRIPTS / "one_rank_probe.py"


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 9), nn.LayerNorm(9), nn.Linear(9, 11))


def config(optimizer: dict[str, Any], stage: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": optimizer,
        "steps_per_print": 10**9,
        **extra,
    }


EXACT_LAMB = {
    "type": "ExactLamb",
    "params": {
        "lr": 0.01,
        "betas": [0.9, 0.999],
        "eps": 1e-6,
        "weight_decay": 0.01,
        "bias_correction": True,
        "trust_clip": None,
        "adapt_all": True,
    },
}


def one_step(engine: Any) -> float:
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(3))
    loss = nn.functional.cross_entropy(engine(ids).reshape(-1, 11), ids.reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_init_distributed_is_idempotent_in_a_plain_process() -> None:
    first = init_distributed()
    assert first == init_distributed()
    assert isinstance(first, DistInfo) and first.rank == 0 and first.world_size >= 1
    assert first.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_exact_lamb_engine_trains_with_our_schedule(stage: int) -> None:
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    engine = build_engine(model, config(EXACT_LAMB, stage=stage), lr_schedule=lambda step: 1.0 / (step + 1))
    lamb = client_optimizer(engine)
    assert isinstance(lamb, ExactLamb)
    assert [g["weight_decay"] for g in lamb.param_groups] == [0.01, 0.0]
    assert lamb.param_groups[0]["lr"] == pytest.approx(0.01)  # multiplier 1 at step 0
    losses = [one_step(engine) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert lamb.param_groups[0]["lr"] == pytest.approx(0.01 / 4)  # stepped once per applied step
    assert (
        lamb.last_trust_ratios() is not None and lamb.last_trust_ratios().numel() == 7
    )  # one per parameter tensor
    wrappers = {0: "none", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
    assert lamb.zero_layout is not None and lamb.zero_layout.wrapper == wrappers[stage]
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        assert all(not torch.equal(a, b.detach()) for a, b in zip(before, params, strict=True))


def test_native_adamw_gets_decay_and_no_decay_groups() -> None:
    engine = build_engine(
        tiny_model(), config({"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.05}})
    )
    optimizer = client_optimizer(engine)
    assert not isinstance(optimizer, ExactLamb)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    one_step(engine)
    with pytest.raises(TypeError, match=r"not pretrain.optim.lamb.ExactLamb"):
        bind_zero_layout(engine)


@pytest.mark.parametrize(
    "ds_config, error, match",
    [
        (config({"type": "Lamb", "params": {"lr": 1e-3, "adapt_all": True}}), ValueError, "ExactLamb"),
        (config({"type": "LAMB", "params": {}}), ValueError, "FusedLamb"),
        (config({"type": "exactlamb", "params": {}}), ValueError, 'did you mean "ExactLamb"'),
        (config({"type": "ExactLamb", "params": {"max_grad_norm": 1.0}}), ValueError, "gradient_clipping"),
        (config({"type": "ExactLamb", "params": {"trust_clip": 3}}), ValueError, "trust_clip"),
        (config({"type": "ExactLamb", "params": {"adapt_all": "yes"}}), ValueError, "adapt_all"),
        (config({"type": "ExactLamb", "params": {"fused": "auto"}}), ValueError, "fused"),
        (config(EXACT_LAMB, stage=0, bf16={"enabled": True}), ValueError, 'needs "zero_optimization"'),
        ({"train_micro_batch_size_per_gpu": 1}, ValueError, '"optimizer" block'),
        ("not a dict", TypeError, "ds_config must be a dict"),
    ],
)
def test_misuse_is_refused_before_deepspeed_starts(ds_config: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build_engine(tiny_model(), ds_config)


def test_schedule_and_scheduler_block_conflict() -> None:
    cfg = config(EXACT_LAMB, scheduler={"type": "WarmupLR", "params": {}})
    with pytest.raises(ValueError, match='"scheduler" block'):
        build_engine(tiny_model(), cfg, lr_schedule=lambda step: 1.0)


def test_rebinding_and_stale_layout() -> None:
    engine = build_engine(tiny_model(), config(EXACT_LAMB, stage=2))
    lamb = client_optimizer(engine)
    one_step(engine)
    lamb.set_zero_layout(ZeroLayout(wrapper="stale"))  # e.g. a layout from another engine
    assert bind_zero_layout(engine) is lamb  # what a driver does after anything that re-creates partitions
    one_step(engine)
    assert len(lamb.zero_layout.partitions) == 2  # one flat partition per param group
    lamb.set_zero_layout(ZeroLayout(wrapper="stale"))
    # (DeepSpeed leaves its wrapper mid-step after this error: the engine is not reusable.)
    with pytest.raises(UnboundZeroLayoutError, match="bind_zero_layout"):
        one_step(engine)


def test_init_distributed_from_slurm_environment() -> None:
    # A fresh interpreter: srun-style variables only, no launcher ones.
    env = {k: v for k, v in deepspeed_cpu_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_JOB_ID="4321")
    env["SLURM_LAUNCH_NODE_IPADDR"] = "127.0.0.1"
    code = (
        "import os; from pretrain.distributed.process_group import init_distributed; info = init_distributed(); "
        "print(info.rank, info.world_size, info.local_rank, os.environ['MASTER_PORT'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-4:] == ["0", "1", "0", str(20000 + 4321 % 20000)]


@pytest.mark.parametrize(
    ("device", "accelerator_backend", "expected"),
    [("cpu", "gloo", "gloo"), ("cpu", "ccl", "gloo"), ("cuda", "nccl", "nccl"), ("xpu", "ccl", "ccl")],
)
def test_backend_follows_the_accelerator_not_the_hardware(
    device: str, accelerator_backend: str, expected: str
) -> None:
    # --cpu on a CUDA machine: the accelerator is "cpu" whatever torch.cuda.is_available() says.
    assert process_group_backend(device, accelerator_backend) == expected


@pytest.mark.parametrize(
    ("local_rank", "visible", "expected"),
    [(3, "2", 0), (3, " 7 ", 0), (3, "0,1,2,3", 3), (3, None, 3), (3, "", 3), (1, "4,5", 1),
     (0, "GPU-6f1c", 0)],
)
def test_device_index_is_zero_when_the_task_sees_one_device(
    local_rank: int, visible: str | None, expected: int
) -> None:
    assert device_index(local_rank, visible) == expected


def test_one_process_run_gets_its_timeout_and_backend_and_leaves_no_shm(tmp_path: Path) -> None:
    """A real 1-process `pretrain.train` (srun-style variables, one GPU bound to the task): the process
    group is gloo with run.dist_timeout_minutes, LOCAL_RANK became the device index 0, and DeepSpeed's
    66 MiB CPU all-reduce segment, which it creates for a world of one too, is gone from /dev/shm."""
    shards = build_shards(tmp_path / "shards", seq_lens=(32,), train=32, val=8)
    config = tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")
    env = {k: v for k, v in deepspeed_cpu_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="3", SLURM_JOB_ID="77",
               CUDA_VISIBLE_DEVICES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               LOCAL_SIZE="1")  # what the DeepSpeed launcher sets; shm.cpp maps segments only when it matches
    out = tmp_path / "probe.json"
    args = ["--config", str(config), '--run.phases=["phase1"]', "--phase1.steps=1",
            "--run.dist_timeout_minutes=77", "--checkpoint.export_at_phase_end=false",
            "--logging.tensorboard=false"]
    proc = subprocess.run([sys.executable, str(PROBE), str(out), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["backend"] == "gloo"
    assert seen["timeout_s"] == 77 * 60
    assert (seen["local_rank"], seen["device_local_rank"]) == ("0", 0)
    if not seen["segment_mapped"]:
        pytest.skip("DeepSpeed's CPU shared-memory all-reduce is not available on this machine")
    assert not seen["segment_listed"]  # unlinked while the process still had it mapped
    assert not Path(seen["segment"]).exists()
