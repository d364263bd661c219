"""Process group setup and the engine builder: the module that drives DeepSpeed (checkpointing/checkpoint.py
only reads DeepSpeed's checkpoint files).

`build_engine` turns a DeepSpeed JSON dict into an engine. Our LAMB is named in the JSON's usual
optimizer block with a type DeepSpeed does not own:

    "optimizer": {"type": "ExactLamb", "params": {"lr": 6e-3, "betas": [0.9, 0.999], "eps": 1e-6,
                  "weight_decay": 0.01, "bias_correction": true, "trust_clip": null, "adapt_all": false}}

DeepSpeed has no optimizer registry, so the builder constructs `pretrain.optim.lamb.ExactLamb` itself, removes the
block, hands the instance to `deepspeed.initialize` and binds the ZeRO layout right after. A
DeepSpeed-native type ("AdamW", "Adam", ...) stays in the config and gets our decay / no-decay groups.
LR schedules are ours: a multiplier function wrapped in a torch LambdaLR that DeepSpeed steps after
every applied optimizer step (config-named torch schedulers break under ZeRO).
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from pretrain.config.sections import DIST_TIMEOUT_MINUTES
from pretrain.dist import DistInfo
from pretrain.engine_parts import client_optimizer  # no DeepSpeed there: the trainer imports it
from pretrain.launch.cluster import device_index, slurm_task_env
from pretrain.launch.extension_builds import reporting_builds
from pretrain.launch.lifetime import die_with_parent
from pretrain.optim.lamb import ExactLamb, bind_zero_layout, weight_decay_param_groups

__all__ = [
    "EXACT_LAMB_TYPE",
    "DistInfo",
    "build_engine",
    "check_ds_config",
    "client_optimizer",
    "device_index",
    "init_distributed",
    "process_group_backend",
    "weight_decay_param_groups",
]

EXACT_LAMB_TYPE = "ExactLamb"
_EXACT_LAMB_PARAMS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "bias_correction",
    "trust_clip",
    "adapt_all",
    "scratch_buffers",  # performance knob, see ExactLamb; null = automatic
    "fused",  # compiled multi-tensor step (pretrain/optim/fused_lamb.py); null = on for CUDA tensors
)




# ---------------------------------------------------------------------- process groups
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _fill_rendezvous_env() -> None:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* from the deepspeed launcher, SLURM, or a lone process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # deepspeed / torchrun launcher
        env.setdefault("LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            raise RuntimeError(
                "RANK and WORLD_SIZE are set but MASTER_PORT is not; set it for the rendezvous"
            )
        return
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun without a launcher
        # The same mapping and rendezvous defaults as launch/slurm_rank.sh (pretrain/launch/cluster.py).
        env.update(slurm_task_env(env))
        return
    # A plain single process (tests, small jobs): a world of one.
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))


SHM_DIR = Path("/dev/shm")


def cpu_shm_segment(rank: int) -> Path:
    """The shared-memory file DeepSpeed 0.19.8's CPU all-reduce (shm.cpp) creates for `rank` of this job."""
    env = os.environ
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_{rank}"


def _release_cpu_shm_names(rank: int, world_size: int) -> None:
    """Unlink this rank's CPU all-reduce segment once every rank has mapped every segment.

    DeepSpeed's shm.cpp creates one ~66 MiB segment per rank and never unlinks it, so every CPU job
    left them in /dev/shm (RAM) for good: hundreds of test launches filled a 24 GB machine. Its
    initialization returns only after a rank has mapped every other rank's segment, so after a
    barrier the names can go; the mappings live on until the processes exit. A world of one creates
    its segment too (and maps no other), so it unlinks at once.
    """
    if world_size > 1:
        dist.barrier()  # on every rank alike (whether a segment exists is not for each rank to decide)
    cpu_shm_segment(rank).unlink(missing_ok=True)


def process_group_backend(device_name: str, communication_backend: str) -> str:
    """The torch.distributed backend for the accelerator DeepSpeed uses, not for the hardware present.

    `--cpu` (DS_ACCELERATOR=cpu) on a machine with GPUs keeps every tensor on the CPU, which NCCL
    cannot reduce, so the choice follows the accelerator: cpu -> gloo (DeepSpeed's shared-memory
    all-reduce sits on top of it), cuda -> nccl, anything else -> that accelerator's own backend.
    """
    if device_name == "cpu":
        return "gloo"
    if device_name == "cuda":
        return "nccl"
    return communication_backend


def started_by_python_launcher() -> bool:
    """True under DeepSpeed's or torch's launcher (or ours, pretrain/launch/agent.py): they start every rank from their main thread and live
    as long as the ranks, so a parent-death signal is safe (not under slurmstepd, whose threads come and go)."""
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return False
    return any(name in parent for name in (b"deepspeed.launcher.launch", b"torch.distributed.run",
                                           b"pretrain.launch.agent"))


def init_distributed(timeout_minutes: int = DIST_TIMEOUT_MINUTES) -> DistInfo:
    """Join (or create) the default process group; idempotent (a second call keeps the first timeout).

    The backend follows the accelerator (process_group_backend); collectives wait up to
    `timeout_minutes` for a busy peer (run.dist_timeout_minutes says why its default is long). LOCAL_RANK is rewritten to the
    device index (device_index, pretrain/launch/cluster.py) before DeepSpeed reads it to bind the device.
    """
    accelerator = get_accelerator()
    if not dist.is_initialized():
        _fill_rendezvous_env()
        local = device_index(int(os.environ["LOCAL_RANK"]), os.environ.get("CUDA_VISIBLE_DEVICES"))
        os.environ["LOCAL_RANK"] = str(local)
        backend = process_group_backend(accelerator.device_name(), accelerator.communication_backend_name())
        if started_by_python_launcher():
            # A rank ends with its launcher (SIGTERM: it checkpoints), even one SIGKILLed (launch.sh's watchdog
            # stops the launcher's whole group; this covers the launcher alone dying).
            die_with_parent()
        # The CPU communication op is compiled here on a machine's first launch: said, and no stale lock waited on.
        with reporting_builds():
            deepspeed.init_distributed(
                dist_backend=backend, auto_mpi_discovery=False, timeout=timedelta(minutes=timeout_minutes)
            )
        if accelerator.device_name() == "cpu":
            _release_cpu_shm_names(dist.get_rank(), dist.get_world_size())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() == "cpu":
        device = torch.device("cpu")
    else:
        accelerator.set_device(local_rank)
        device = torch.device(accelerator.device_name(local_rank))
    return DistInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device
    )


# ---------------------------------------------------------------------- optimizer config
def _exact_lamb_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(params) - set(_EXACT_LAMB_PARAMS))
    if unknown:
        hint = (
            ' (use the top-level "gradient_clipping"; LAMB never clips on its own)'
            if "max_grad_norm" in unknown
            else ""
        )
        raise ValueError(
            f'ds_config["optimizer"]["params"]: unknown key(s) {unknown} for type "{EXACT_LAMB_TYPE}"{hint}; '
            f"allowed: {list(_EXACT_LAMB_PARAMS)}"
        )
    kwargs = dict(params)
    if "betas" in kwargs:
        betas = kwargs["betas"]
        if not isinstance(betas, list | tuple) or len(betas) != 2:
            raise ValueError(f'ds_config["optimizer"]["params"]["betas"] must be [b1, b2], got {betas!r}')
        kwargs["betas"] = (float(betas[0]), float(betas[1]))
    if kwargs.get("trust_clip") is not None:
        clip = kwargs["trust_clip"]
        if not isinstance(clip, list | tuple) or len(clip) != 2:
            raise ValueError(
                f'ds_config["optimizer"]["params"]["trust_clip"] must be null or [lo, hi], got {clip!r}'
            )
        kwargs["trust_clip"] = (float(clip[0]), float(clip[1]))
    for flag in ("bias_correction", "adapt_all", "scratch_buffers", "fused"):
        if (
            flag in kwargs
            and not isinstance(kwargs[flag], bool)
            and not (flag in ("scratch_buffers", "fused") and kwargs[flag] is None)
        ):
            raise ValueError(
                f'ds_config["optimizer"]["params"]["{flag}"] must be true or false, got {kwargs[flag]!r}'
            )
    return kwargs


def _optimizer_block(ds_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    block = ds_config.get("optimizer")
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ValueError(
            'ds_config needs an "optimizer" block: {"type": "ExactLamb" | "AdamW" | ..., "params": {...}}'
        )
    params = block.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f'ds_config["optimizer"]["params"] must be an object, got {type(params).__name__}')
    optimizer_type = block["type"]
    if optimizer_type.lower() == "lamb":
        raise ValueError(
            f'ds_config["optimizer"]["type"] = "{optimizer_type}" selects DeepSpeed\'s CUDA-only FusedLamb, which '
            f'computes one trust ratio per flat ZeRO partition instead of per layer. Use "{EXACT_LAMB_TYPE}" '
            "(this toolkit's LAMB, exact under ZeRO 0-3)."
        )
    if optimizer_type.lower() == EXACT_LAMB_TYPE.lower() and optimizer_type != EXACT_LAMB_TYPE:
        raise ValueError(
            f'ds_config["optimizer"]["type"] = "{optimizer_type}": did you mean "{EXACT_LAMB_TYPE}"?'
        )
    return optimizer_type, params


def _refuse_low_precision_without_zero(config: dict[str, Any]) -> None:
    """fp16/bf16 at ZeRO stage 0 selects DeepSpeed's FP16_UnfusedOptimizer, which runs one optimizer
    step with zero gradients while it is constructed: LAMB would apply weight decay (ratio 1/wd) to the
    fp32 masters before training starts. ZeRO-1/2 are exact and also more accurate for bf16."""
    low_precision = [
        k for k in ("fp16", "bf16") if isinstance(config.get(k), dict) and config[k].get("enabled")
    ]
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if low_precision and stage == 0:
        raise ValueError(
            f'ds_config: "{EXACT_LAMB_TYPE}" with {low_precision[0]} needs "zero_optimization": {{"stage": 1}} or '
            "higher (DeepSpeed's stage-0 fp16/bf16 wrapper steps the optimizer once with zero gradients at start-up)"
        )


def check_ds_config(ds_config: dict[str, Any]) -> None:
    """Every check `build_engine` makes on a DeepSpeed dict, without a model or a process group.

    The driver runs it for every phase before phase 1 starts, so a bad phase-2 JSON (an unknown LAMB
    key, bf16 at ZeRO stage 0, a negative beta) is a config error at start-up, not a traceback hours
    later. Raises ValueError naming the key.
    """
    optimizer_type, params = _optimizer_block(ds_config)
    if optimizer_type == EXACT_LAMB_TYPE:
        _refuse_low_precision_without_zero(ds_config)
        ExactLamb([torch.zeros(1, requires_grad=True)], **_exact_lamb_kwargs(params))  # its own range checks


# ---------------------------------------------------------------------- engine
def build_engine(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    lr_schedule: Callable[[int], float] | None = None,
    mpu: object | None = None,
) -> Any:
    """A DeepSpeedEngine for `model` from the DeepSpeed JSON dict `ds_config` (see module docstring).

    lr_schedule(step) is the multiplier of each group's base lr at optimizer step `step` (0-based).
    mpu is an optional DeepSpeed mpu object (disjoint data-parallel groups for codistillation).
    """
    if not isinstance(ds_config, dict):
        raise TypeError(f"ds_config must be a dict (a parsed DeepSpeed JSON), got {type(ds_config).__name__}")
    init_distributed()
    config = copy.deepcopy(ds_config)  # check_ds_config's checks run below, as the optimizer is built
    optimizer_type, params = _optimizer_block(config)
    if lr_schedule is not None and "scheduler" in config:
        raise ValueError('ds_config has a "scheduler" block and an lr_schedule was given: keep only one')

    def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        # DeepSpeed calls this with the client ("basic") optimizer, whose param_groups the ZeRO
        # wrappers share, so the lr written here is the lr every partition steps with.
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule)

    scheduler = make_scheduler if lr_schedule is not None else None

    if optimizer_type == EXACT_LAMB_TYPE:
        _refuse_low_precision_without_zero(config)
        kwargs = _exact_lamb_kwargs(params)
        groups = weight_decay_param_groups(model, float(kwargs.get("weight_decay", 0.01)))
        optimizer = ExactLamb(groups, **kwargs)
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, lr_scheduler=scheduler, mpu=mpu
        )
        bind_zero_layout(engine)  # also refreshed lazily when a checkpoint load re-creates partitions
        return engine

    groups = weight_decay_param_groups(model, float(params.get("weight_decay", 0.0)))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups, config=config, lr_scheduler=scheduler, mpu=mpu
    )
    return engine


@contextlib.contextmanager
def full_parameters(engine: Any) -> Iterator[list[torch.Tensor]]:
    """The engine's module parameters, whole, in named_parameters order.

    ZeRO-3 keeps each rank's slice only; the gather is a collective inside the engine's
    data-parallel group, so every rank of that group must enter together.
    """
    params = [p for _, p in engine.module.named_parameters()]
    # Anything holding a `.module` works (a plain module wrapper has no ZeRO stage: nothing to gather).
    stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield params
    else:
        yield params
