"""The unpadded path on the device: which attention kernel runs, and padded vs unpadded agreement.

Once per group whose rows run unpadded (the recipe's phase 1 and phase 2), on the group's engine, on the
first micro-batch of its first unpadded row's shards, collated in both layouts with the same masks (the
production collate), in eval mode (no dropout) and the engine's compute dtype:
- the CUDA kernels of one unpadded forward under torch's profiler: those named "flash" must be there
  (the varlen kernel of pretrain/model/varlen_attention.py); on CPU the reference kernel runs by design
  (n/a);
- the loss of both layouts: relative difference within AGREEMENT_RTOL (bf16 rounds both paths
  differently; in fp32 the tests hold them to 1e-5).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.gpu_check.plan import GroupSpec
from bench.gpu_check.shards import ShardCache
from pretrain.data.batches import Collator, PhaseData, RankBatches, open_phase_data
from pretrain.data.loader import model_inputs

AGREEMENT_RTOL = 2e-2
ATTENTION_HEADER = ("| attention check | model | seq | micro | flash kernel on the device | loss padded | "
                    "loss unpadded | rel. difference | agree |\n|---|---|---|---|---|---|---|---|---|")


def both_layouts(data: PhaseData, micro_batch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first micro-batch of the shards' stream, padded and unpadded, masked by the same generators."""
    stream = RankBatches(data, "train", 0, 0, 1, micro_batch)
    indices = [int(i) for i in stream.rank_indices(0)[:micro_batch]]
    rows = [stream.reader[i] for i in indices]
    layouts = []
    for unpadded in (False, True):
        layouts.append(Collator(data, unpadded=unpadded)(rows, [np.random.default_rng([0, i]) for i in indices]))
    return layouts[0], layouts[1]


def cuda_kernel_names(prof: profile) -> list[str]:
    return sorted({event.key for event in prof.key_averages() if event.device_type == DeviceType.CUDA})


@torch.no_grad()
def attention_row(module: torch.nn.Module, group: GroupSpec, shards: ShardCache, device: torch.device) -> dict[str, Any]:
    row = next(r for r in group.rows if r.unpadded)
    data = open_phase_data(shards.get(group.seq_len, row.profile, group.micro_batch), group.seq_len, None,
                           f"{row.name} shards", verify_checksums=False)
    padded, unpadded = both_layouts(data, group.micro_batch)
    was_training = module.training
    module.eval()
    try:
        loss_padded = float(module(**model_inputs(padded, device)).loss)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            loss_unpadded = float(module(**model_inputs(unpadded, device)).loss)  # float(): waits for the device
    finally:
        module.train(was_training)
    flash = [name for name in cuda_kernel_names(prof) if "flash" in name.lower()]
    difference = abs(loss_unpadded - loss_padded) / max(abs(loss_padded), 1e-12)
    return {"name": f"{row.name}-attention", "model": group.preset, "seq_len": group.seq_len,
            "micro_batch": group.micro_batch, "flash_kernels": flash[:3],
            "flash_ran": bool(flash) if device.type == "cuda" else None, "loss_padded": loss_padded,
            "loss_unpadded": loss_unpadded, "rel_diff": difference, "agree": difference <= AGREEMENT_RTOL}


def attention_markdown(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"| {r['name']} | {r['status']}: {r['reason']} |"
    kernel = "n/a (CPU: reference kernel)" if r["flash_ran"] is None else (
        f"yes: {', '.join(r['flash_kernels'])}" if r["flash_ran"] else "NO (no flash kernel ran)")
    return (f"| {r['name']} | {r['model']} | {r['seq_len']} | {r['micro_batch']} | {kernel} | {r['loss_padded']:.4f} | "
            f"{r['loss_unpadded']:.4f} | {r['rel_diff']:.2e} | {'yes' if r['agree'] else 'NO'} |")
