"""Run on N ranks by tests/optim/test_lamb_zero.py: ExactLamb under ZeRO 0/1/2/3 vs a single-process ExactLamb.

Every rank also trains the reference itself (one process, the whole global batch, no DeepSpeed), so
no result crosses processes except through the engine under test. Rank 0 writes one JSON with, per
scenario, the max abs weight difference (max over ranks), the trust ratios, and each step's gradient norm per
parameter group as the step monitor logs it from the partitions (pretrain/metrics/grad_groups.py) and as the
reference's whole gradients give it before clipping.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn

from pretrain.distributed.process_group import init_distributed
from pretrain.engine import build_engine
from pretrain.metrics.grad_groups import GroupGradNorms
from pretrain.optim.lamb import ExactLamb, UnboundZeroLayoutError, weight_decay_param_groups
from pretrain.optim.lamb_reference import NaiveLamb
from pretrain.optim.unwrap import client_optimizer
from pretrain.step_stats import StepCounts, StepResult
from tests.support.launching import leave_without_teardown

VOCAB, WIDTH, HIDDEN, SEQ = 37, 15, 33, 6  # odd sizes: padding everywhere, params straddle partitions
LAMB_PARAMS = {"lr": 6e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01, "adapt_all": True}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.l1 = nn.Linear(WIDTH, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(torch.tanh(self.l1(self.emb(ids)))))


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@dataclass
class Scenario:
    name: str
    stage: int
    zero: dict[str, Any] = field(default_factory=dict)
    grad_accum: int = 1
    clip: float = 0.0
    bf16: bool = False
    steps: int = 4
    naive: bool = False  # a textbook per-tensor LAMB that knows nothing of ZeRO
    checkpoint_after: int | None = None  # save, rebuild an engine from scratch, load, continue
    lamb: dict[str, Any] = field(default_factory=dict)
    # Every rank gets the same micro-batch, so the averaged gradient equals the single-process one
    # bit for bit and any weight difference is the optimizer's. With distinct data the reduction's
    # rounding (~1 ulp of each gradient) is amplified by Adam where m nearly cancels.
    replicated: bool = True


def global_batches(steps: int, micro: int, grad_accum: int, ranks_with_own_data: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, grad_accum, ranks_with_own_data * micro, SEQ + 1), generator=gen)


def fresh_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def group_of(name: str) -> str:
    """TinyLM's parameter groups for grad_norm/<group>: one per module (emb, l1, ln, out)."""
    return name.split(".")[0]


def group_norms(model: nn.Module) -> dict[str, float]:
    """The whole (unpartitioned) gradient's norm per group: what grad_norm/<group> must equal."""
    squares: dict[str, float] = {}
    for name, p in model.named_parameters():
        squares[group_of(name)] = squares.get(group_of(name), 0.0) + float(p.grad.double().square().sum())
    return {f"grad_norm/{group}": value**0.5 for group, value in squares.items()}


def reference_run(sc: Scenario, batches: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                                                 list[dict[str, float]]]:
    model = fresh_model()
    params = {**LAMB_PARAMS, **sc.lamb}
    params.pop("scratch_buffers", None)  # the reference always takes ExactLamb's default code path
    opt = ExactLamb(
        weight_decay_param_groups(model, params["weight_decay"]),
        **{**params, "betas": tuple(params["betas"])},
    )
    norms = []
    for step in range(batches.shape[0]):
        opt.zero_grad()
        for micro in range(batches.shape[1]):
            (loss_of(model, batches[step, micro]) / batches.shape[1]).backward()
        norms.append(group_norms(model))
        if sc.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), sc.clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt.last_trust_ratios(), norms


def ds_config(sc: Scenario, micro: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": sc.grad_accum,
        "zero_optimization": {"stage": sc.stage, **sc.zero},
        "optimizer": {"type": "ExactLamb", "params": {**LAMB_PARAMS, **sc.lamb}},
        "steps_per_print": 10**9,
        # DeepSpeed clips at 1.0 unless told otherwise; the reference clips exactly when this does.
        "gradient_clipping": sc.clip,
    }
    if "offload_optimizer" in sc.zero:
        cfg["zero_force_ds_cpu_optimizer"] = False  # keep our client optimizer on the offloaded partitions
    if sc.bf16:
        cfg["bf16"] = {"enabled": True}
        if sc.stage == 1:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}  # selects BF16_Optimizer
    return cfg


def make_engine(sc: Scenario, micro: int) -> Any:
    model = fresh_model()
    cfg = ds_config(sc, micro)
    if not sc.naive:
        return build_engine(model, cfg)
    del cfg["optimizer"]
    cfg["zero_allow_untested_optimizer"] = True
    naive = NaiveLamb(
        weight_decay_param_groups(model, LAMB_PARAMS["weight_decay"]),
        **{**LAMB_PARAMS, "betas": (0.9, 0.999)},
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=naive, config=cfg)
    return engine


def train(engine: Any, batches: torch.Tensor, steps: range, micro: int, rank: int,
          monitor: GroupGradNorms | None = None, logged: list[dict[str, float]] | None = None) -> None:
    """Rank r trains on rows [r*micro, (r+1)*micro) of each global batch (all rows if replicated); `monitor` is
    called as the trainer calls it and each step's numbers appended to `logged`, with DeepSpeed's grad_norm."""
    if batches.shape[2] == micro:
        rank = 0
    for step in steps:
        for m in range(batches.shape[1]):
            ids = batches[step, m, rank * micro : (rank + 1) * micro].to(engine.device)
            engine.backward(loss_of(engine, ids))
            if monitor is not None and m == batches.shape[1] - 1:
                monitor.before_step()
            engine.step()
        if monitor is not None and logged is not None:
            result = StepResult(applied=engine.was_step_applied(), nonfinite=False, values={},
                                counts=StepCounts(0, 0, 0, 0))
            global_norm = engine.get_global_grad_norm()
            logged.append({**monitor.values(result), **({} if global_norm is None else {"grad_norm": float(global_norm)})})


def full_weights(engine: Any, stage: int, bf16: bool) -> dict[str, torch.Tensor]:
    """The trained weights: the fp32 masters for bf16 runs (the model copy is rounded to bf16)."""
    if bf16:
        return {n: safe_get_full_fp32_param(p).float().cpu() for n, p in engine.module.named_parameters()}
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def zero3_padded_params(engine: Any) -> list[str]:
    """ZeRO-3: parameters whose per-rank partition ends in (uninitialised) padding."""
    world = dist.get_world_size()
    return [n for n, p in engine.module.named_parameters() if hasattr(p, "ds_numel") and p.ds_numel % world]


def straddling_params(engine: Any) -> list[str]:
    """ZeRO-1/2: names of parameters cut by a partition boundary (all ranks agree)."""
    wrapper = engine.optimizer
    if type(wrapper).__name__ != "DeepSpeedZeroOptimizer":
        return []
    names = {id(p): n for n, p in engine.module.named_parameters()}
    cut = []
    for i, group in enumerate(wrapper.round_robin_bit16_groups):
        size = int(wrapper.partition_size[i])
        for p, off in zip(group, wrapper.round_robin_bit16_offsets[i], strict=True):
            if (off // size) != ((off + p.numel() - 1) // size):
                cut.append(names[id(p)])
    return cut


def run_scenario(sc: Scenario, micro: int, ckpt_root: Path) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(sc.steps, micro, sc.grad_accum, 1 if sc.replicated else world)
    ref_weights, ref_ratios, ref_norms = reference_run(sc, batches)
    engine = make_engine(sc, micro)
    monitor, logged = GroupGradNorms(group_of), []
    monitor.attach(engine)
    split_at = sc.checkpoint_after if sc.checkpoint_after is not None else sc.steps
    train(engine, batches, range(split_at), micro, rank, monitor, logged)
    if sc.checkpoint_after is not None:
        ckpt = ckpt_root / sc.name
        engine.save_checkpoint(str(ckpt), tag="mid")
        engine = make_engine(sc, micro)  # a fresh engine with fresh flat partitions
        engine.load_checkpoint(str(ckpt), tag="mid")
        monitor.attach(engine)
        train(engine, batches, range(split_at, sc.steps), micro, rank, monitor, logged)
    weights = full_weights(engine, sc.stage, sc.bf16)
    diff = max((weights[n] - ref_weights[n]).abs().max().item() for n in ref_weights)
    rel_l2 = max(((weights[n] - ref_weights[n]).norm() / ref_weights[n].norm()).item() for n in ref_weights)
    diff_t = torch.tensor([diff, rel_l2], dtype=torch.float64)
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    result: dict[str, Any] = {
        "max_abs_diff": diff_t[0].item(),
        "max_rel_l2": diff_t[1].item(),
        "wrapper": type(engine.optimizer).__name__,
        "straddling": straddling_params(engine),
        "zero3_padded": zero3_padded_params(engine),
        "ref_ratios": ref_ratios.tolist(),
        "group_norms": logged,  # rank 0's: every rank computes the same after the all-reduce
        "ref_group_norms": ref_norms,
    }
    if not sc.naive:
        ratios = client_optimizer(engine).last_trust_ratios()
        result["ratios"] = ratios.tolist()
        result["max_ratio_diff"] = (ratios.double() - ref_ratios.double()).abs().max().item()
        kernels = client_optimizer(engine)._fused_kernels  # set once a flat partition took the fused step
        result["fused_compiled"] = bool(kernels is not None and kernels.compiled)
    return result


def unbound_error_message(micro: int) -> str:
    """deepspeed.initialize with ExactLamb but no bind_zero_layout: the first step must refuse."""
    model = fresh_model()
    cfg = ds_config(Scenario("unbound", stage=2), micro)
    del cfg["optimizer"]
    cfg["zero_allow_untested_optimizer"] = True
    lamb = ExactLamb(weight_decay_param_groups(model, 0.01), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=lamb, config=cfg)
    batches = global_batches(1, micro, 1, 1)
    try:
        train(engine, batches, range(1), micro, dist.get_rank())
    except UnboundZeroLayoutError as error:
        return str(error)
    return ""


SCENARIOS = {
    "stage0": Scenario("stage0", 0),
    "stage1": Scenario("stage1", 1),
    "stage2": Scenario("stage2", 2),
    "stage3": Scenario("stage3", 3),
    "stage3_subgroups": Scenario("stage3_subgroups", 3, zero={"sub_group_size": 300}),
    # the accelerator code path (multi-tensor kernels with temporaries) on flat partitions
    "stage2_foreach": Scenario("stage2_foreach", 2, lamb={"scratch_buffers": False}),
    "stage3_foreach": Scenario("stage3_foreach", 3, lamb={"scratch_buffers": False}),
    "stage2_round_robin": Scenario("stage2_round_robin", 2, zero={"round_robin_gradients": True}),
    "stage2_accum_clip": Scenario("stage2_accum_clip", 2, grad_accum=2, clip=0.05),
    "stage2_distinct_data": Scenario("stage2_distinct_data", 2, grad_accum=2, clip=0.05, replicated=False),
    "stage3_distinct_data": Scenario("stage3_distinct_data", 3, replicated=False),
    "stage1_trust_clip_no_adapt": Scenario(
        "stage1_trust_clip_no_adapt", 1, lamb={"trust_clip": [0.05, 1.0], "adapt_all": False}
    ),
    "stage2_offload": Scenario("stage2_offload", 2, zero={"offload_optimizer": {"device": "cpu"}}),
    "stage3_offload": Scenario("stage3_offload", 3, zero={"offload_optimizer": {"device": "cpu"}}),
    "stage2_checkpoint": Scenario("stage2_checkpoint", 2, steps=5, checkpoint_after=3),
    "stage3_checkpoint": Scenario("stage3_checkpoint", 3, steps=5, checkpoint_after=3),
    "bf16_optimizer": Scenario("bf16_optimizer", 1, bf16=True, replicated=False),
    "stage2_bf16": Scenario("stage2_bf16", 2, bf16=True, replicated=False),
    # the torch.compile'd flat-partition kernels (pretrain/optim/fused_lamb.py), forced on (they default to CUDA only)
    "stage2_fused": Scenario("stage2_fused", 2, grad_accum=2, clip=0.05, lamb={"fused": True}),
    "stage3_fused": Scenario("stage3_fused", 3, lamb={"fused": True}),
    "naive_stage0": Scenario("naive_stage0", 0, naive=True),
    "naive_stage2": Scenario("naive_stage2", 2, naive=True),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--micro", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = init_distributed()
    results: dict[str, Any] = {"world_size": info.world_size}
    for name in args.scenarios.split(","):
        if name == "unbound":
            results[name] = {"error": unbound_error_message(args.micro)}
            continue
        results[name] = run_scenario(SCENARIOS[name], args.micro, args.out.parent / "ckpt")
        if info.rank == 0:
            print(name, json.dumps({k: v for k, v in results[name].items() if "ratios" not in k}), flush=True)
    if info.rank == 0:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, args.out)
    dist.barrier()
    return (
        0
        if all(math.isfinite(r.get("max_abs_diff", 0.0)) for r in results.values() if isinstance(r, dict))
        else 1
    )


if __name__ == "__main__":
    leave_without_teardown(main())
