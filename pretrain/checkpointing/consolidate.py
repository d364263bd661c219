"""A checkpoint's fp32 weights, merged from every rank's partition and keyed like the module, read as data.

What `export`, `phaseN.init_from` and the start of the next phase read. Every file goes through safe_load.py
(`weights_only=True`); DeepSpeed's zero_to_fp32 would load each with `weights_only=False`, so its merge is
done here, on the same layouts:

- ZeRO stage 0: rank 0's model states hold the whole module (its weights are the fp32 masters).
- ZeRO-1/2 and DeepSpeed's BF16_Optimizer (what the GPU recipes get: bf16 + ZeRO-1 + fp32 gradient
  accumulation; zero_to_fp32 refuses it, "is not a zero checkpoint", as its state carries no `zero_stage`):
  per parameter group, the trainable parameters flattened in module order, padded at the end to a
  multiple of 2 x data-parallel size, cut into one equal partition per rank. The ranks' fp32 partitions
  are concatenated in rank order and the parameters sliced back out in the order the model states record
  (with the alignment paddings, if the state records them); only the end padding may be left.
- ZeRO-3: every parameter is cut into ceil(numel / ranks) elements per rank, and each rank's fp32 flats
  hold its pieces in module order; each parameter is its pieces of every rank, concatenated and cut to size.

Buffers come from rank 0's model states; tied names (`shared_params`) map to their holder's tensor.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpointing.safe_load import load_data

__all__ = ["consolidated_state_dict"]

# DeepSpeed 0.19.8's keys in its checkpoint files (deepspeed/checkpoint/constants.py): the on-disk format
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
ZERO_STAGE = "zero_stage"
PARTITION_COUNT = "partition_count"
FLAT_PARTITIONS = "single_partition_of_fp32_groups"  # ZeRO-1/2 and BF16_Optimizer
STAGE3_FLATS = "fp32_flat_groups"
ALIGNMENT_PADDINGS = "param_alignment_paddings"
PARAM_SHAPES, BUFFER_NAMES = "param_shapes", "buffer_names"
FROZEN_SHAPES, FROZEN_FRAGMENTS = "frozen_param_shapes", "frozen_param_fragments"
# the moments: not needed for the weights, dropped as each file is read
MOMENTS = ("optimizer_state_dict", "base_optimizer_state")
_RANK = re.compile(r"zero_pp_rank_(\d+)_")


def _by_rank(files: list[Path]) -> list[Path]:
    """Files in rank order (rank 10 after rank 9); a model states file without a rank (ZeRO-1/2's) first."""
    return sorted(files, key=lambda f: int(m.group(1)) if (m := _RANK.search(f.name)) else -1)


def consolidated_state_dict(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights of the checkpoint `root/tag` (module docstring)."""
    folder = root / tag
    models = _by_rank(list(folder.glob("*_model_states.pt")))
    if not models:
        raise FileNotFoundError(f"{folder}: no DeepSpeed model states")
    optimizers = _by_rank(list(folder.glob("*_optim_states.pt")))
    if not optimizers:  # ZeRO stage 0
        module = load_data(models[0])["module"]
        return {key: value.float() for key, value in module.items()}
    parts = [_partition(file) for file in optimizers]
    counts: set[int] = set()
    for part in parts:
        count = part.get(PARTITION_COUNT)
        counts.update(count if isinstance(count, list) else [count])
    if counts != {len(parts)}:
        raise ValueError(f"{folder}: {len(parts)} optimizer partition files, but they were written by "
                         f"{sorted(counts, key=str)} ranks (a rank's file is missing or from another run)")
    stage3 = ZERO_STAGE in parts[0] and int(parts[0][ZERO_STAGE]) == 3
    if stage3:
        states = [load_data(file) for file in models]
        weights = _stage3_weights(folder, states, parts)
    elif FLAT_PARTITIONS in parts[0]:
        states = [load_data(models[0])]
        weights = _flat_weights(folder, states[0], parts)
    else:
        raise ValueError(f"{optimizers[0]}: neither a ZeRO nor a BF16_Optimizer partition")
    for alias, target in states[0]["shared_params"].items():
        if target in weights:
            weights[alias] = weights[target]
    return weights


def _partition(file: Path) -> dict[str, Any]:
    state = load_data(file, mmap=True)[OPTIMIZER_STATE_DICT]
    for key in MOMENTS:
        state.pop(key, None)
    return state


def _buffers(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    names = set(state[BUFFER_NAMES])
    return {k: v.float() if v.is_floating_point() else v for k, v in state["module"].items() if k in names}


def _flat_weights(folder: Path, state: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """ZeRO-1/2 and BF16_Optimizer: one flat per parameter group, cut into equal partitions (module docstring)."""
    world = len(parts)
    weights = _buffers(state)
    for name, shape in (state.get(FROZEN_SHAPES) or {}).items():
        weights[name] = state[FROZEN_FRAGMENTS][name].float().view(shape)
    paddings = parts[0].get(ALIGNMENT_PADDINGS)
    for group, shapes in enumerate(state[PARAM_SHAPES]):
        flat = torch.cat([part[FLAT_PARTITIONS][group].detach().float().reshape(-1) for part in parts])
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise ValueError(f"{folder}: parameter group {group} holds {flat.numel()} values, fewer than its "
                                 f"parameters need")
            weights[name] = flat.narrow(0, offset, numel).view(shape).clone()
            offset += numel + (paddings[group][index] if paddings is not None else 0)
        if not 0 <= flat.numel() - offset < 2 * world:
            raise ValueError(f"{folder}: parameter group {group} holds {flat.numel()} values, its parameters "
                             f"{offset}: not a ZeRO-1/2 or BF16_Optimizer layout")
    return weights


def _stage3_weights(folder: Path, states: list[dict[str, Any]], parts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """ZeRO-3: each parameter's pieces of every rank, concatenated and cut to size (module docstring)."""
    world = len(parts)
    weights = _buffers(states[0])
    for name, shape in (states[0].get(FROZEN_SHAPES) or {}).items():
        pieces = [state[FROZEN_FRAGMENTS][name].float().reshape(-1) for state in states]
        weights[name] = torch.cat(pieces).narrow(0, 0, math.prod(shape)).view(shape).clone()
    flats = [torch.cat([g.detach().float().reshape(-1) for g in part[STAGE3_FLATS]]) for part in parts]
    shapes = {name: shape for group in states[0][PARAM_SHAPES] for name, shape in group.items()}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        piece = math.ceil(numel / world)
        if offset + piece > flats[0].numel():
            raise ValueError(f"{folder}: the ranks' ZeRO-3 partitions hold {flats[0].numel()} values each, fewer "
                             "than the parameters need")
        weights[name] = torch.cat([flat.narrow(0, offset, piece) for flat in flats]).narrow(0, 0, numel).view(shape)
        offset += piece
    if offset != flats[0].numel():
        raise ValueError(f"{folder}: the parameters take {offset} of the {flats[0].numel()} values of each rank's "
                         "ZeRO-3 partition: not this layout")
    return weights
