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
* filesystem - each group's first rank publishes its weights to `<exchange_dir>/group<g>/` (atomic
  file + atomic `latest`) and every rank loads the others' latest files, as in Anil et al. 2018.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data_prep.shards import atomic_write_bytes
from pretrain.engine import full_parameters
from pretrain.model import SparseBertForPreTraining, build_model

LATEST = "latest"
_KEEP_PUBLISHED = 2  # a reader may still be opening the previous file while the next is written


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


def publish_weights(engine: Any, folder: Path, step: int, is_writer: bool) -> None:
    """Collective inside the group (ZeRO-3 gather); the group's first rank writes step file + `latest`."""
    own = flat_weights(engine)
    if not is_writer:
        return
    name = f"weights-step{step:08d}.pt"
    buffer = io.BytesIO()
    torch.save({"step": step, "flat": own.detach().cpu()}, buffer)
    atomic_write_bytes(folder / name, buffer.getvalue())
    atomic_write_bytes(folder / LATEST, name.encode("utf-8"))
    for old in sorted(folder.glob("weights-step*.pt"))[:-_KEEP_PUBLISHED]:
        old.unlink(missing_ok=True)


def load_published(folder: Path, teacher: torch.nn.Module) -> int | None:
    """Load the newest weights another group published; None when it has published nothing yet."""
    pointer = folder / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    payload = torch.load(folder / name, map_location="cpu", weights_only=True)
    device = next(teacher.parameters()).device
    dtype = next(teacher.parameters()).dtype
    load_flat(teacher, payload["flat"].to(device=device, dtype=dtype))
    return int(payload["step"])


# ---------------------------------------------------------------------------------------------- loss
def soft_targets(teacher_logits: list[torch.Tensor], temperature: float) -> torch.Tensor:
    """The teachers' averaged predicted distribution at temperature T (fp32)."""
    probs = [F.softmax(t.float() / temperature, dim=-1) for t in teacher_logits]
    return torch.stack(probs).mean(0)


def distillation_loss(student_logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                      kind: str) -> torch.Tensor:
    """T^2 x mean over rows of KL(targets || student_T) or of the cross-entropy -sum targets log student_T.

    Both have the same gradient; KL is zero when the student matches, which reads better in logs.
    The T^2 factor keeps gradient magnitudes comparable across temperatures (Hinton et al. 2015).
    """
    if student_logits.shape[0] == 0:
        return student_logits.float().sum() * 0.0
    log_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    per_row = -(targets * log_student).sum(-1)
    if kind == "kl":
        per_row = per_row + torch.special.xlogy(targets, targets).sum(-1)
    elif kind != "soft_ce":
        raise ValueError(f"codistill.loss: unknown kind {kind!r}")
    return per_row.mean() * temperature**2
