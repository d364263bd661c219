"""Frozen teacher copies of the other groups' models, their refresh, and the distillation loss.

A teacher is a plain module (never a DeepSpeed engine: one engine per process, because DeepSpeed
keeps the mpu in a process global), in eval mode, without gradients, in the student's compute dtype.

Full weights of a student. ZeRO-1/2 keep the module's compute-precision parameters whole on every
rank (the fp32 masters are partitioned, and re-gathered into the module after every step), so the
module parameters are the model. ZeRO-3 partitions the module parameters themselves; they are
gathered by `pretrain.engine.full_parameters` (a collective inside the data-parallel group).

Exchange:
* collective - every rank all-gathers the flat weights over its exchange group (same position in
  every group), so each rank receives the other groups' current weights directly.
* filesystem - each group publishes its weights to files and reads the others' (exchange.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain.engine import full_parameters
from pretrain.model.bert import SparseBertForPreTraining, build_model


def zero_stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0


def flat_weights(engine: Any) -> torch.Tensor:
    """One contiguous vector of the student's weights (compute dtype, on its device)."""
    with full_parameters(engine) as params, torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in params])


@torch.no_grad()
def load_flat(module: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a `flat_weights` vector into a module of the same architecture (named_parameters order)."""
    params = [param for _, param in module.named_parameters()]
    expected = sum(param.numel() for param in params)
    if flat.numel() != expected:
        raise ValueError(f"teacher weights: expected {expected} values, received {flat.numel()} (other architecture?)")
    offset = 0
    for param in params:
        param.copy_(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()


def make_teacher(model_config: Any, device: torch.device, dtype: torch.dtype) -> SparseBertForPreTraining:
    teacher = build_model(model_config).to(device=device, dtype=dtype)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def engine_dtype(engine: Any) -> torch.dtype:
    if hasattr(engine, "bfloat16_enabled") and engine.bfloat16_enabled():
        return torch.bfloat16
    if hasattr(engine, "fp16_enabled") and engine.fp16_enabled():
        return torch.float16
    return torch.float32


def collective_refresh(engine: Any, teachers: dict[int, torch.nn.Module], exchange_group: Any, group: int,
                       groups: int) -> None:
    """All-gather every group's flat weights over the exchange group; load the others' into `teachers`."""
    own = flat_weights(engine).contiguous()
    gathered = torch.empty(groups * own.numel(), dtype=own.dtype, device=own.device)
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; same signature.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, own, group=exchange_group)
    for other, teacher in teachers.items():
        load_flat(teacher, gathered[other * own.numel() : (other + 1) * own.numel()])
    del gathered


# ---------------------------------------------------------------------------------------------- loss
def soft_targets(teacher_logits: list[torch.Tensor], temperature: float) -> torch.Tensor:
    """The teachers' averaged predicted distribution at temperature T (fp32)."""
    probs = [F.softmax(t.float() / temperature, dim=-1) for t in teacher_logits]
    return torch.stack(probs).mean(0)


def distillation_loss(student_logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                      kind: str, valid: torch.Tensor | None = None) -> torch.Tensor:
    """T^2 x mean over rows of KL(targets || student_T) or of the cross-entropy -sum targets log student_T.

    Both have the same gradient; KL is zero when the student matches, which reads better in logs.
    The T^2 factor keeps gradient magnitudes comparable across temperatures (Hinton et al. 2015).
    `valid` (bool per row): only those rows count, the mean is over them (0 when there are none). The
    MLM head returns every slot, labelled or not (a fixed shape, no host sync), so the caller passes
    the labelled mask instead of selecting rows with it.
    """
    if student_logits.shape[0] == 0:
        return student_logits.float().sum() * 0.0
    log_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    per_row = -(targets * log_student).sum(-1)
    if kind == "kl":
        per_row = per_row + torch.special.xlogy(targets, targets).sum(-1)
    elif kind != "soft_ce":
        raise ValueError(f"codistill.loss: unknown kind {kind!r}")
    if valid is None:
        return per_row.mean() * temperature**2
    # where, not a product: a non-finite row outside the mask must not turn the sum into NaN
    total = torch.where(valid, per_row, torch.zeros_like(per_row)).sum()
    return total / valid.sum().clamp_min(1) * temperature**2
