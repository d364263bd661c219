"""Start/end logits for every window, computed on all ranks and gathered on rank 0 exactly once.

Each rank takes one contiguous block of the windows (``np.array_split``: sizes differ by at most
one). Every rank runs the same number of forward passes, padding the short ones with a repeat of
a window whose output is thrown away, because under ZeRO-3 each forward gathers parameters
collectively and a rank that stopped early would hang the others. Rank 0 then checks that the
gathered window indices are exactly 0..n-1, once each, before anything is scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pretrain.distributed.json_collectives import all_gather_float32, all_gather_json
from pretrain.finetune.squad.features import Features, pad_batch

Rows = list[tuple[int, np.ndarray, np.ndarray]]  # (window index, start logits, end logits)


def rank_block(num_windows: int, world_size: int, rank: int) -> np.ndarray:
    """The window indices this rank scores."""
    return np.array_split(np.arange(num_windows), world_size)[rank]


def check_exactly_once(indices: list[int], num_windows: int) -> None:
    counts = np.bincount(np.asarray(indices, dtype=np.int64), minlength=num_windows)
    missing = np.flatnonzero(counts == 0)
    repeated = np.flatnonzero(counts > 1)
    if len(counts) != num_windows or len(missing) or len(repeated):
        raise RuntimeError(
            f"evaluation gathered {len(indices)} windows for {num_windows}: missing {missing[:10].tolist()}, "
            f"repeated {repeated[:10].tolist()}"
        )


def gather_rows(rows: Rows) -> Rows:
    """Every rank's rows in rank order, on every rank: each row's window index and length as JSON, the logits as
    raw float32 (bit for bit), never a pickle a peer could have written (pretrain/distributed/json_collectives.py)."""
    shapes = all_gather_json([[index, len(start)] for index, start, _ in rows])
    flat = np.concatenate([part for _, start, end in rows for part in (start, end)]) if rows else np.zeros(0)
    gathered: Rows = []
    for part_shapes, values in zip(shapes, all_gather_float32(flat), strict=True):
        at = 0
        for index, length in part_shapes:
            gathered.append((index, values[at : at + length], values[at + length : at + 2 * length]))
            at += 2 * length
    return gathered


@torch.no_grad()
def local_logits(
    forward: Callable[..., Any], features: Features, block: np.ndarray, rounds: int, batch_size: int,
    pad_id: int, device: torch.device,
) -> Rows:
    """Run ``rounds`` forward passes over ``block`` (padding with a discarded window when it runs out)."""
    rows: Rows = []
    for r in range(rounds):
        chosen = block[r * batch_size : (r + 1) * batch_size].tolist()
        real = len(chosen)
        if real == 0:
            chosen = [0]  # keeps this rank in step with the others; the output is discarded
        batch = pad_batch(features, chosen, pad_id)
        inputs = {k: torch.from_numpy(batch[k]).to(device) for k in ("input_ids", "token_type_ids", "attention_mask")}
        output = forward(**inputs)
        start = output.start_logits.float().cpu().numpy()
        end = output.end_logits.float().cpu().numpy()
        for row in range(real):
            n = len(features.input_ids[chosen[row]])
            rows.append((chosen[row], start[row, :n].copy(), end[row, :n].copy()))
    return rows


def gather_logits(
    forward: Callable[..., Any], features: Features, batch_size: int, pad_id: int, device: torch.device,
) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """All windows' logits in window order on rank 0 (None on the other ranks)."""
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    block = rank_block(len(features), world_size, rank)
    rounds = math.ceil(math.ceil(len(features) / world_size) / batch_size)
    rows = local_logits(forward, features, block, rounds, batch_size, pad_id, device)
    if distributed and world_size > 1:
        rows = gather_rows(rows)
        if rank != 0:
            return None
    check_exactly_once([index for index, _, _ in rows], len(features))
    rows.sort(key=lambda row: row[0])
    return [start for _, start, _ in rows], [end for _, _, end in rows]
