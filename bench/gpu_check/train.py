"""The training rows of bench/gpu_check/run.py: the production step, `PhaseTrainer.train_step`, timed.

Each group (bench/gpu_check/plan.py) builds the engine the way the driver does (`pretrain.train.plan_run`
on the recipe with only the batch, the data folder and, for --smoke, the model and shapes replaced;
`build_engine` with the phase's LR schedule). Each row then builds a `PhaseTrainer` as `run_phase` does,
over the real `RankBatches` of synthetic shards (bench/gpu_check/shards.py) and the recipe's
`data.num_workers` DataLoader, and times the body of the trainer's loop without checkpoints and
validation: `train_step()` (A micro-batches read, masked and collated by the workers, loss normalisation,
forward/backward, one optimizer step, one statistics all-reduce), `step_metrics` and `log_step` (with
TensorBoard off). The step ends in a host read of the statistics, so wall time per step is the device's.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpu_check.plan import GroupSpec, RowSpec
from bench.gpu_check.shards import ShardCache
from pretrain.checkpointing.checkpoint import CheckpointManager
from pretrain.config.deepspeed import read_ds_json
from pretrain.config.load import RunConfig, load_config
from pretrain.data.batches import PhaseData, open_phase_data
from pretrain.distributed.info import DistInfo
from pretrain.distributed.stop_request import StopRequest
from pretrain.engine import build_engine
from pretrain.metrics.throughput import Throughput, peak_tflops
from pretrain.metrics.writer import MetricsWriter
from pretrain.model.bert import build_model, count_parameters
from pretrain.model.compiled import CompileLedger, compile_metrics, compiled_layer
from pretrain.model.setup import prepare_model_path
from pretrain.optim.unwrap import client_optimizer
from pretrain.plan.run_plan import RunPlan, plan_run
from pretrain.step_stats import StepCounts, StepResult
from pretrain.trainer import PhaseState, PhaseTrainer, TrainerJob

# An 80 GB H100 shows 81,559 MiB (79.6 GiB); the CUDA context takes ~1 GiB outside PyTorch's allocator (est.).
GPU_80GB_GIB, CUDA_CONTEXT_GIB = 79.6, 1.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class GroupEngine:
    """One group's engine and what its rows share."""

    config: RunConfig
    plan: RunPlan
    engine: Any
    counts: dict[str, int]
    build_s: float


def group_overrides(group: GroupSpec, args: argparse.Namespace, shards: Path, accumulation: int,
                    world_size: int) -> list[str]:
    """The recipe, with the batch for `accumulation` micro-batches per step on this machine, the synthetic
    data and the timer setting; --smoke adds bf16 (the GPU's precision, so CPU runs the same bf16
    optimizer wrapper), the model and the shapes."""
    p = group.phase
    overrides = [
        f"--data.shards={shards}", f"--run.dir={args.work_dir / 'run'}", f'--run.phases=["{p}"]',
        "--logging.tensorboard=false", "--logging.progress_bar=false",
        f"--model.preset={group.preset}", f"--{p}.seq_len={group.seq_len}", f"--{p}.shards=null",
        f"--{p}.micro_batch_size={group.micro_batch}", f"--{p}.gradient_accumulation_steps={accumulation}",
        f"--{p}.batch_size={group.micro_batch * accumulation * world_size}",
        f"--{p}.ds_overrides.timers.throughput.enabled={'true' if group.tput_timer else 'false'}",
    ]
    if args.ds_config is not None:
        overrides.append(f"--{p}.ds_config={args.ds_config.resolve()}")
    if args.num_workers is not None:
        overrides.append(f"--data.num_workers={args.num_workers}")
    if args.smoke:
        overrides.append("--run.precision=bf16")
    return overrides


def build_group(group: GroupSpec, args: argparse.Namespace, shards: ShardCache, dist_info: DistInfo,
                ledger: CompileLedger | None = None) -> GroupEngine:
    """The group's engine as the driver builds it; `ledger`: the compiled layer's over the recipe's engines (the
    driver's is one per process over its phases), so a later phase's recompile counts on from the earlier's."""
    first = group.rows[0]
    folder = shards.get(group.seq_len, first.profile, group.micro_batch)
    config = load_config(group.recipe, group_overrides(group, args, folder, first.accumulation,
                                                       dist_info.world_size))
    plan = plan_run(config, dist_info, verify_checksums=False)
    phase = plan.phases[group.phase]
    torch.manual_seed(phase.run.seed)
    started = time.perf_counter()
    model = build_model(phase.model_config, phase.model.activation_checkpointing)
    # as pretrain.train.build_phase: refuses what the unpadded kernel cannot run, compiles where the plan says
    prepare_model_path(model, phase.attention, ledger=ledger)
    counts = count_parameters(model)
    engine = build_engine(model, phase.ds_config, lr_schedule=phase.schedule)
    sync(dist_info.device)
    return GroupEngine(config, plan, engine, counts, time.perf_counter() - started)


def lamb_step_kind(engine: Any) -> str:
    """Which step ExactLamb ran inside the engine: the reference multi-tensor step, the compiled fused
    one, or the fused math uncompiled (fused=None falls back there when compiling fails)."""
    kernels = getattr(client_optimizer(engine), "_fused_kernels", None)
    if kernels is None:
        return "reference"
    return "fused" if kernels.compiled else "fused-eager (compile failed)"


def make_trainer(built: GroupEngine, group: GroupSpec, row: RowSpec, data: PhaseData, args: argparse.Namespace,
                 dist_info: DistInfo) -> PhaseTrainer:
    """A PhaseTrainer as `pretrain.train.build_phase` builds it, for this row's layout (no validation, no
    checkpoint is written)."""
    engine = built.engine
    if engine.micro_steps % engine.gradient_accumulation_steps():
        raise RuntimeError(f"engine at micro-step {engine.micro_steps}, not at an accumulation boundary "
                           f"(a previous row of the group stopped mid-step)")
    engine.set_train_batch_size(group.micro_batch * row.accumulation * dist_info.world_size)
    phase = built.plan.phases[group.phase]
    layout = dataclasses.replace(phase.stream.layout, packing=row.packing)  # a copy: the plan's section stays
    stream = dataclasses.replace(phase.stream, layout=layout, unpadded=row.unpadded)
    batches = stream.batches(data, "train", dist_info.rank, dist_info.world_size, group.micro_batch)
    peak = peak_tflops(dist_info.device, phase.precision, args.peak_tflops)
    throughput = Throughput.of(dataclasses.replace(phase.throughput, predictions=data.max_predictions,
                                                   peak_tflops=peak), dist_info.world_size)
    job = TrainerJob(Path(built.config.run.dir), built.plan.resolved, dist_info,
                     CheckpointManager(args.work_dir / "ckpt", 1, dist_info.rank), MetricsWriter(None, False),
                     StopRequest())
    return PhaseTrainer(job, phase.trainer, engine, batches, None, throughput, PhaseState(group.phase))


def loop_step(trainer: PhaseTrainer) -> StepResult:
    """One iteration of `PhaseTrainer.train`'s loop, without validation and checkpoints."""
    result = trainer.train_step()
    trainer.state.step += 1
    trainer.steps_this_process += 1
    trainer.state.samples_seen += trainer.global_batch
    trainer.log_step(trainer.step_metrics(result))
    return result


def total_counts(results: list[StepResult]) -> StepCounts:
    return sum((r.counts for r in results[1:]), results[0].counts)


def data_wait_ms(results: list[StepResult]) -> float | None:
    """Mean time per step the loop waited for the DataLoader (the trainer's perf/data_wait_s), None without it."""
    waits = [r.values.get("perf/data_wait_s") for r in results]
    return None if None in waits else 1e3 * sum(waits) / len(waits)  # type: ignore[arg-type]


def shipped_timer(ds_config: str) -> bool:
    """Whether a DeepSpeed JSON leaves DeepSpeed's throughput timer on (its default when unset)."""
    ds = read_ds_json(ds_config, ds_config)
    return bool(ds.get("timers", {}).get("throughput", {}).get("enabled", True))


def memory(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"peak_alloc_gb": None, "peak_reserved_gb": None, "fits_80gb": None}
    reserved = torch.cuda.max_memory_reserved(device) / 2**30
    return {"peak_alloc_gb": torch.cuda.max_memory_allocated(device) / 2**30, "peak_reserved_gb": reserved,
            "fits_80gb": reserved + CUDA_CONTEXT_GIB <= GPU_80GB_GIB}


def train_row(built: GroupEngine, group: GroupSpec, row: RowSpec, args: argparse.Namespace, shards: ShardCache,
              dist_info: DistInfo) -> dict[str, Any]:
    """Warm-up optimizer steps (the first of the process also compiles the fused LAMB), then the timed ones."""
    device = dist_info.device
    data = open_phase_data(shards.get(group.seq_len, row.profile, group.micro_batch), group.seq_len, None,
                           f"{row.name} shards", verify_checksums=False)
    trainer = make_trainer(built, group, row, data, args, dist_info)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    steps = args.boundary_steps if row.accumulation == 1 else args.steps
    try:
        sync(device)
        started = time.perf_counter()
        loop_step(trainer)  # also starts the DataLoader workers
        first_step_s = time.perf_counter() - started
        for _ in range(args.warmup - 1):
            loop_step(trainer)
        results, times = [], []
        for _ in range(steps):
            started = time.perf_counter()
            results.append(loop_step(trainer))
            times.append(time.perf_counter() - started)
        sync(device)
        engine = trainer.engine
        ds_config = str(Path(built.config.phase(group.phase).ds_config).resolve())
        counts = total_counts(results)
        seconds = sum(times)
        rates = trainer.throughput.rates(counts, seconds)
        step_s = seconds / steps
        return {
            "name": row.name, "what": row.what, "recipe": str(group.recipe), "phase": group.phase,
            "model": group.preset, "seq_len": group.seq_len, "micro_batch": group.micro_batch,
            "accumulation": trainer.accumulation, "profile": row.profile, "packing": row.packing,
            "unpadded": row.unpadded, **compile_state(engine.module),
            "tput_timer": bool(engine.tput_timer.config.enabled),
            "shipped_tput_timer": shipped_timer(ds_config), "num_workers": trainer.settings.feed.num_workers,
            "precision": "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32",
            "wrapper": type(engine.optimizer).__name__, "lamb_step": lamb_step_kind(engine),
            "params": built.counts["total"], "ds_config": ds_config,
            "steps": steps, "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times),
            "micro_ms": step_s / trainer.accumulation * 1e3, "seq_time_ms": seconds / counts.instances * 1e3,
            "inst_per_s": rates["perf/instances_per_s"], "rows_per_step": counts.rows / steps,
            "real_tokens_per_s": rates["perf/real_tokens_per_s"], "device_tflops": rates["perf/device_tflops"],
            # device_*: the device's work, padding included (perf/device_mfu); model_mfu: the model's, on real tokens
            # only: what a run logs as perf/mfu (the number to compare with a run's)
            "device_mfu": rates.get("perf/device_mfu"), "model_mfu": rates.get("perf/mfu"),
            **counts.data_stats(group.seq_len), **memory(device),
            "data_wait_ms": data_wait_ms(results),
            "loss": results[-1].values["loss/total"], "build_s": built.build_s, "first_step_s": first_step_s,
        }
    finally:
        del trainer  # ends the DataLoader workers


def compile_state(module: torch.nn.Module) -> dict[str, Any]:
    """`compile_metrics` (compile/*: recompiles, fallback, recompile_limit, graph_breaks, seconds) and what a row
    prints beside them: the graphs compiled for the layer so far (compile/graphs) and why it runs eager after a
    fallback (compile_fallback); empty where the layer is not compiled (padded path, CPU, model.compile=false)."""
    layer = compiled_layer(module)
    if layer is None:
        return {}
    return {**compile_metrics(module), "compile/graphs": float(layer.graphs), "compile_fallback": layer.fallback}


def group_key(group: GroupSpec, row: RowSpec) -> dict[str, Any]:
    return {"name": row.name, "model": group.preset, "phase": group.phase, "seq_len": group.seq_len,
            "micro_batch": group.micro_batch, "accumulation": row.accumulation, "profile": row.profile,
            "packing": row.packing, "unpadded": row.unpadded, "tput_timer": group.tput_timer}

