"""Resume on a different number of ranks: a world-size-free copy of a checkpoint's training state.

A DeepSpeed checkpoint of N ranks holds the fp32 master weights and the optimizer moments as N flat
partitions per parameter group (ZeRO-1/2, BF16_Optimizer) or per sub-group (ZeRO-3), cut wherever
the partition boundaries fall. Our LAMB's moments live in those flats, so a checkpoint only loads
into an engine with the same partitioning. Three pieces make it portable:

1. `write_layout_record` (every rank, at every save): which slice of which parameter each segment of
   this rank's flats holds, from the same bookkeeping LAMB steps with (pretrain/optim/zero_layout.py), into
   `elastic_layout_rankNNNNN.json`. A few kilobytes; it is exact with round-robin gradients,
   parameter alignment and ZeRO-3 sub-groups alike.
2. `convert` (once, by rank 0, when a job finds a checkpoint of another world size): reads the N
   optimizer files and the records and writes `elastic_state.pt` in the tag folder: per parameter the
   fp32 weight and every per-element optimizer state (`exp_avg`, `exp_avg_sq`), per param group the
   scalar states (`step`), the LR scheduler, DeepSpeed's step counters and the loss scaler. Temp file
   + rename: a crash leaves either no file or a whole one; the next start converts again.
3. `load_converted` (every rank of the new job, after the engine exists): copies each parameter's slices
   into the new flats and moments (and into the compute-precision module weights), restores the
   scheduler and counters. Nothing is averaged or recomputed: the values are the saved ones, bit for bit.

Every file is read as data (`_read`: safe_load.py), the converted state by every rank included: an
`elastic_state.pt` found in the tag folder is reused as it is, so it is no more trusted than any other file.

Why not DeepSpeed's universal checkpoints: see docs/elastic_resume.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from data_prep.shard_format.atomic_io import atomic_write_json, atomic_write_stream
from pretrain.checkpointing.layout import CONSOLIDATED, RUN_CONFIG, TRAINER_STATE
from pretrain.checkpointing.safe_load import UnsafeCheckpointError, load_data
from pretrain.distributed.json_collectives import broadcast_json
from pretrain.errors import ConfigError, ResumeError
from pretrain.optim.zero_layout import FlatPartition, flat_views

__all__ = ["CONSOLIDATED", "load_converted", "prepare_resume", "write_layout_record"]
FORMAT = "bert-ds-elastic-state/1"
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


class ElasticError(ValueError):
    """A checkpoint cannot be moved to another world size; the message names the file or key."""


def layout_record_name(rank: int) -> str:
    return f"elastic_layout_rank{rank:05d}.json"


def _segments(partition: FlatPartition) -> list[list[int]]:
    """[param index j, start in the flat, length, start inside the parameter] per segment."""
    if len(partition.param_starts) != len(partition.param_indices):
        raise ElasticError("the ZeRO layout does not record where its segments start inside their parameters")
    starts = [0]
    for size in partition.piece_sizes:
        starts.append(starts[-1] + size)
    return [[j, starts[piece], partition.piece_sizes[piece], inside]
            for j, piece, inside in zip(partition.param_indices, partition.segment_pieces, partition.param_starts,
                                        strict=True)]


def layout_record(engine: Any) -> dict[str, Any]:
    """This rank's record: the wrapper kind and, per flat the client optimizer steps, its segments."""
    client = engine.basic_optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}

    def shape(p: torch.Tensor) -> list[int]:
        return list(getattr(p, "ds_shape", p.shape))

    views = flat_views(engine, client)
    if views is None:
        groups = [{"names": [names[id(p)] for p in g["params"]], "shapes": [shape(p) for p in g["params"]]}
                  for g in client.param_groups]
        return {"kind": "none", "groups": groups}
    flats = [{"group": v.group, "numel": v.flat.numel(), "names": [names[id(p)] for p in v.params],
              "shapes": [shape(p) for p in v.params], "segments": _segments(v.partition)} for v in views]
    return {"kind": type(engine.optimizer).__name__, "flats": flats}


def write_layout_record(engine: Any, folder: Path, rank: int) -> None:
    """Every rank, right after its part of a checkpoint: see the module docstring (piece 1)."""
    atomic_write_json(folder / layout_record_name(rank), layout_record(engine))


# ---------------------------------------------------------------------- converter (rank 0, offline)
def _read(path: Path) -> Any:
    """A checkpoint file as data (safe_load.py): a file that needs a type outside the allowlist is refused as it
    is (UnsafeCheckpointError names the file and the type); any other failure is named here."""
    try:
        return load_data(path, mmap=True)
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # a truncated or foreign file: name it, whatever torch raised
        raise ElasticError(f"{path}: unreadable ({type(err).__name__}: {err})") from err


def _model_states(folder: Path) -> dict[str, Any]:
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (folder / name).is_file():
            return _read(folder / name)
    raise ElasticError(f"{folder}: no DeepSpeed model states of rank 0")


def _flat_states(folder: Path, rank: int, kind: str) -> tuple[list[torch.Tensor], list[dict[str, Any]], Any]:
    """(fp32 flats, the client optimizer's state per flat, loss scaler or None) of one rank's optimizer file."""
    files = sorted(folder.glob(f"*zero_pp_rank_{rank}_mp_rank_*optim_states.pt"))
    if len(files) != 1:
        raise ElasticError(f"{folder}: expected one optimizer file of rank {rank}, found {[f.name for f in files]}")
    saved = _read(files[0])["optimizer_state_dict"]
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        flats, base = saved["fp32_flat_groups"], saved["optimizer_state_dict"]
    else:
        flats, base = saved["single_partition_of_fp32_groups"], saved["base_optimizer_state"]
    # ZeRO-1/2 "elastic_checkpoint": a list of per-group states; otherwise a torch state_dict, one index per flat
    states = list(base) if isinstance(base, list) else [base["state"].get(k, {}) for k in range(len(flats))]
    scaler = {key: saved[key] for key in ("loss_scaler", "dynamic_loss_scale") if key in saved}
    return list(flats), states, scaler or None


def _split_state(state: dict[str, Any], shape: torch.Size | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Per-element tensors (moments: shaped like the parameter, or 1-D in a flat) and per-group scalars
    (`step`) of one optimizer state entry."""
    per_element, scalars = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and (value.shape == shape if shape is not None else value.dim() == 1):
            per_element[key] = value
        else:
            scalars[key] = value.item() if torch.is_tensor(value) else value
    return per_element, scalars


def _merge_scalars(groups: dict[int, dict[str, Any]], group: int, scalars: dict[str, Any], where: str) -> None:
    known = groups.setdefault(group, dict(scalars))
    if known != scalars:
        raise ElasticError(f"{where}: param group {group} has different scalar optimizer states {known} != {scalars}")


def convert(folder: Path, world_size: int) -> dict[str, Any]:
    """The world-size-free state of the checkpoint in `folder`, written by `world_size` ranks."""
    records = []
    for rank in range(world_size):
        path = folder / layout_record_name(rank)
        if not path.is_file():
            raise ElasticError(f"{path} is missing: this checkpoint does not record its ZeRO layout (written before "
                               "elastic resume existed?); resume it on its own number of ranks")
        records.append(json.loads(path.read_text(encoding="utf-8")))
    kind = records[0]["kind"]
    states = _model_states(folder)
    params: dict[str, dict[str, torch.Tensor]] = {}
    group_scalars: dict[int, dict[str, Any]] = {}
    scaler = None
    if kind == "none":  # ZeRO-0: rank 0's model states hold the whole module and the optimizer
        module, optimizer = states["module"], states["optimizer"]
        for g, group in enumerate(records[0]["groups"]):
            for j, name in enumerate(group["names"]):
                index = optimizer["param_groups"][g]["params"][j]
                per_element, scalars = _split_state(optimizer["state"].get(index, {}), module[name].shape)
                params[name] = {"weight": module[name].float().clone(),
                                **{k: v.reshape(module[name].shape).clone() for k, v in per_element.items()}}
                _merge_scalars(group_scalars, g, scalars, str(folder))
    else:
        filled: dict[str, int] = {}
        for rank, record in enumerate(records):
            flats, optimizer_states, rank_scaler = _flat_states(folder, rank, kind)
            scaler = scaler if rank else rank_scaler
            if len(flats) != len(record["flats"]):
                raise ElasticError(f"{folder}: rank {rank} saved {len(flats)} flat partitions, its record lists "
                                   f"{len(record['flats'])}")
            for flat, state, flat_record in zip(flats, optimizer_states, record["flats"], strict=True):
                per_element, scalars = _split_state(state, None)
                _merge_scalars(group_scalars, flat_record["group"], scalars, f"{folder} rank {rank}")
                sources = {"weight": flat, **per_element}
                for j, start, length, inside in flat_record["segments"]:
                    name = flat_record["names"][j]
                    numel = int(torch.Size(flat_record["shapes"][j]).numel())
                    full = params.setdefault(name, {key: torch.zeros(numel) for key in sources})
                    for key, source in sources.items():
                        full[key].narrow(0, inside, length).copy_(source.narrow(0, start, length).float())
                    filled[name] = filled.get(name, 0) + length
        shapes = {n: s for r in records for f in r["flats"] for n, s in zip(f["names"], f["shapes"], strict=True)}
        for name, shape in shapes.items():
            numel = int(torch.Size(shape).numel())
            if filled.get(name, 0) != numel:
                raise ElasticError(f"{folder}: the ranks' partitions hold {filled.get(name, 0)} of the {numel} "
                                   f"elements of {name}")
            params[name] = {key: value.view(shape) for key, value in params[name].items()}
    return {
        "format": FORMAT, "source": {"world_size": world_size, "wrapper": kind, "tag": folder.name},
        "params": params, "group_scalars": [group_scalars[g] for g in sorted(group_scalars)],
        "lr_scheduler": states.get("lr_scheduler"), "engine": {k: states.get(k) for k in ENGINE_COUNTERS},
        "loss_scaler": scaler,
    }


def convert_once(folder: Path, world_size: int) -> tuple[Path, str]:
    """Write `elastic_state.pt` unless a whole one is there; returns (path, what was done, for the log)."""
    out = folder / CONSOLIDATED
    if out.is_file():
        return out, f"reused {out.name} (converted earlier)"
    began = time.perf_counter()
    state = convert(folder, world_size)
    atomic_write_stream(out, lambda handle: torch.save(state, handle))
    kind = state["source"]["wrapper"]
    what = "the ZeRO-0 (unpartitioned) state" if kind == "none" else f"the {kind} partitions"
    return out, (f"converted {what} of {len(state['params'])} parameters into {out.name} "
                 f"({out.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - began:.1f} s)")


# ---------------------------------------------------------------------- loader (every rank of the new job)
@torch.no_grad()
def load_converted(engine: Any, path: Path) -> None:
    """Put a converted state into a freshly built engine of any world size (see the module docstring)."""
    state = _read(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ElasticError(f"{path}: not an elastic state file of this toolkit")
    client, params = engine.basic_optimizer, state["params"]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if set(names.values()) != set(params):
        missing, extra = sorted(set(names.values()) - set(params)), sorted(set(params) - set(names.values()))
        raise ElasticError(f"{path}: the model's parameters differ from the checkpoint's (missing {missing[:3]}, "
                           f"unexpected {extra[:3]})")
    scalars = state["group_scalars"]
    views = flat_views(engine, client)
    if views is None:
        for g, group in enumerate(client.param_groups):
            for p in group["params"]:
                saved = params[names[id(p)]]
                p.data.copy_(saved["weight"].view_as(p))
                client.state[p] = {**{k: v.to(p.device).clone() for k, v in saved.items() if k != "weight"},
                                   **scalars[g]}
    else:
        for view in views:
            flat = view.flat
            keys = [k for k in params[names[id(view.params[0])]] if k != "weight"] if view.params else []
            moments = {key: torch.zeros_like(flat) for key in keys}
            for j, start, length, inside in _segments(view.partition):
                saved = params[names[id(view.params[j])]]
                flat.narrow(0, start, length).copy_(saved["weight"].reshape(-1).narrow(0, inside, length))
                for key, moment in moments.items():
                    moment.narrow(0, start, length).copy_(saved[key].reshape(-1).narrow(0, inside, length))
            client.state[flat] = {**moments, **scalars[view.group]}
        _copy_module_weights(engine, params, names)
        link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # DeepSpeed's per-parameter views (safe_get_full_optimizer_state) onto these moments
            link()
    if state["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for group, lr in zip(client.param_groups, engine.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    for key, value in state["engine"].items():
        if value is not None:
            setattr(engine, key, value)
    if state["loss_scaler"] and hasattr(engine.optimizer, "loss_scaler"):
        for key, value in state["loss_scaler"].items():
            setattr(engine.optimizer, key, value)


def _copy_module_weights(engine: Any, params: dict[str, dict[str, torch.Tensor]], names: dict[int, str]) -> None:
    """The compute-precision weights the forward pass uses: whole tensors (ZeRO-1/2, BF16_Optimizer), or this
    rank's slice of every parameter (ZeRO-3), rounded from the fp32 masters as an optimizer step does."""
    import torch.distributed as dist

    for p in engine.module.parameters():
        weight = params[names[id(p)]]["weight"].reshape(-1)
        if hasattr(p, "ds_tensor"):
            rank = dist.get_rank(group=p.ds_process_group)
            size = p.ds_tensor.ds_numel
            valid = max(0, min(size, p.ds_numel - rank * size))
            if valid:
                p.ds_tensor.data.narrow(0, 0, valid).copy_(weight.narrow(0, rank * size, valid))
        else:
            p.data.copy_(weight.view_as(p))


# ---------------------------------------------------------------------- the driver's resume check
def prepare_resume(root: Path, tag: str, ds_configs: dict[str, dict[str, Any]], rank: int, world_size: int,
                   src: int = 0, group: Any = None) -> None:
    """Before any engine exists: refuse what cannot continue exactly, and convert once (rank 0, shared
    verdict) when the checkpoint was written by another number of ranks. `src`/`group`: this model's
    first global rank and process group (codistillation), else rank 0 and the world."""
    import torch.distributed as dist

    state = json.loads((root / tag / TRAINER_STATE).read_text(encoding="utf-8"))
    if state.get("complete"):
        return  # the next phase starts from the consolidated weights, which do not depend on the world size
    phase = state["phase"]
    if state.get("data_order", 1) != 2:
        raise ResumeError(f"checkpoint.dir: {root / tag} counts its data position in micro-batches of one rank (an "
                          "older version); finish that phase with the version that wrote it, or start the phase "
                          "from it with phaseN.init_from in a new checkpoint.dir")
    saved = json.loads((root / tag / RUN_CONFIG).read_text(encoding="utf-8"))["resolved"]
    before = saved["ds_configs"][phase]["train_batch_size"]
    now = ds_configs.get(phase, {}).get("train_batch_size", before)
    if before != now:
        ds = ds_configs[phase]
        raise ConfigError(
            f"{phase}.batch_size: {root / tag} trained with a global batch of {before} sequences, this job's is {now} "
            f"(micro batch {ds['train_micro_batch_size_per_gpu']} x accumulation {ds['gradient_accumulation_steps']} "
            f"x {world_size} ranks); set {phase}.batch_size={before} with a {phase}.micro_batch_size and no "
            f"{phase}.gradient_accumulation_steps, so the accumulation is derived for any number of ranks")
    if saved["world_size"] == world_size:
        return
    error: list[str | None] = [None]
    if rank == 0:
        try:
            path, what = convert_once(root / tag, saved["world_size"])
            print(f"elastic resume: {root / tag} was written by {saved['world_size']} ranks, this job has "
                  f"{world_size}; {what}; loading it into the new partitions", flush=True)
        except (ElasticError, UnsafeCheckpointError, OSError, KeyError) as err:
            error[0] = f"checkpoint.dir: cannot resume {root / tag} on {world_size} ranks: {err}"
    if world_size > 1 and dist.is_initialized():
        error[0] = broadcast_json(error[0], src=src, group=group)  # as JSON: never unpickled
    if error[0] is not None:
        raise ResumeError(error[0])
