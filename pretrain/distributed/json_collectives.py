"""Small values between ranks as JSON, never as pickles: all_gather_json, broadcast_json, all_gather_float32.

torch's `all_gather_object` and `broadcast_object_list` pickle what a rank sends and unpickle what its peers
send. The ranks meet in an unauthenticated TCP store (pretrain/distributed/rank_store.py), which tells each rank
where its peers listen: someone who can write that store can point a rank's peer connection at themselves and
send it a pickle, which runs as you. What the toolkit exchanges (failures, votes, manifest entries, verdicts,
predictions) is data, so it travels as JSON text in a uint8 tensor (lengths gathered first, each payload padded to
the longest), and numeric arrays as raw little-endian float32 bytes: nothing a peer sends is ever code.

JSON has no tuples: a tuple sent arrives as a list (the readers unpack both alike). A value JSON cannot write
(a set, a dataclass, a numpy array) is a TypeError on the sender, before anything is sent. NaN and infinities
pass (Python's json writes them as NaN/Infinity).

tests/pretrain/test_house_guards.py keeps torch's `*_object` collectives out of pretrain/.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors: the CPU for gloo (and MPI), else this rank's accelerator device
    (NCCL reduces device tensors only)."""
    backend = str(dist.get_backend(group))
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if "gloo" in backend or "mpi" in backend or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def all_gather_bytes(payload: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `payload`, in group rank order, on every rank of `group` (None: the world)."""
    device = _device(group)
    size = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(each.item()) for each in lengths)
    if longest == 0:
        return [b""] * size
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    return [part[: int(each.item())].cpu().numpy().tobytes() for part, each in zip(parts, lengths, strict=True)]


def broadcast_bytes(payload: bytes, src: int, group: dist.ProcessGroup | None = None) -> bytes:
    """`src`'s payload on every rank of `group` (`src`: a global rank, as torch's broadcasts take it); what the
    other ranks pass is ignored."""
    device = _device(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if int(length.item()) == 0:
        return b""
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == src and payload:
        buffer[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return buffer.cpu().numpy().tobytes()


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON value, in group rank order, on every rank (tuples arrive as lists)."""
    return [json.loads(part.decode("utf-8")) for part in all_gather_bytes(_encode(value), group)]


def broadcast_json(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """`src`'s JSON value on every rank (the others' `value` is ignored, but must be JSON too)."""
    payload = _encode(value) if dist.get_rank() == src else b""
    return json.loads(broadcast_bytes(payload, src, group).decode("utf-8"))


def all_gather_float32(values: np.ndarray, group: dist.ProcessGroup | None = None) -> list[np.ndarray]:
    """Every rank's flat float32 array (any length), in group rank order, bit for bit: logits too many for JSON
    text (a float as text is about five times its four bytes)."""
    mine = np.ascontiguousarray(values, dtype="<f4").ravel()
    return [np.frombuffer(part, dtype="<f4").copy() for part in all_gather_bytes(mine.tobytes(), group)]
