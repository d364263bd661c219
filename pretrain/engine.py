"""The engine builder: the module that drives DeepSpeed's engine (checkpointing/checkpoint.py only reads
DeepSpeed's checkpoint files; pretrain/distributed/process_group.py joins the process group).

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
from collections.abc import Callable, Iterator
from typing import Any

import deepspeed
import torch

from pretrain.distributed.process_group import init_distributed
from pretrain.optim.lamb import ExactLamb, bind_zero_layout, weight_decay_param_groups

__all__ = ["EXACT_LAMB_TYPE", "build_engine", "check_ds_config", "full_parameters", "rebind_optimizer"]

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


def rebind_optimizer(engine: Any) -> None:
    """After a checkpoint load re-created ZeRO's partitions: an ExactLamb is bound to the new layout at once
    (it would rebind lazily at its next step). Other optimizers need nothing."""
    if isinstance(getattr(engine, "basic_optimizer", None), ExactLamb):
        bind_zero_layout(engine)


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
