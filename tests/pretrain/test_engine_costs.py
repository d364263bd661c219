"""What the shipped GPU engine does per micro-batch and per step that a GPU user pays for, counted on CPU.

The engine is built the way the driver builds phase 1 of the shipped recipe (load_config -> phase_ds_config
with run.precision resolved as on a GPU with bf16 -> build_engine with the phase's schedule): bf16 + ZeRO-1 +
fp32 gradient accumulation, i.e. DeepSpeed's BF16_Optimizer around ExactLamb, here on one in-process CPU rank
with accumulation 4. Pass-through spies count the real calls:

- device synchronisations (`get_accelerator().synchronize()`, `torch.cuda.synchronize()` on a GPU): DeepSpeed's
  throughput timer, on by default and synchronised, drains the device at the start and end of every
  micro-batch from the third optimizer step on; the shipped JSONs turn it off (`timers.throughput.enabled`).
- the gradient all-reduce at the accumulation boundary: in bf16 by default (DeepSpeed's
  communication_data_type follows bf16), which rounds the fp32-accumulated gradient before the cross-rank
  sum; the shipped JSON asks for fp32 (`communication_data_type`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from pretrain.config.deepspeed import phase_ds_config
from pretrain.config.load import load_config
from pretrain.distributed.process_group import init_distributed
from pretrain.engine import build_engine
from pretrain.model.bert import bert_config, build_model
from pretrain.schedules.lr import build_schedule
from tests.support.paths import REPO_ROOT

RECIPE = REPO_ROOT / "ds_configs" / "recipes" / "bert_large_64k.json"
MICRO, ACCUMULATION, OPTIMIZER_STEPS, SEQ, VOCAB = 2, 4, 5, 32, 128


@dataclass
class Counts:
    """Per optimizer step: device synchronisations, and the all-reduces as (dtype, numel)."""

    syncs: list[int] = field(default_factory=list)
    all_reduces: list[list[tuple[torch.dtype, int]]] = field(default_factory=list)
    wrapper: str = ""
    parameters: int = 0
    communication_dtype: torch.dtype | None = None


def micro_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    return dict(input_ids=torch.randint(5, VOCAB, (MICRO, SEQ), generator=generator),
                token_type_ids=torch.zeros(MICRO, SEQ, dtype=torch.long),
                attention_mask=torch.ones(MICRO, SEQ, dtype=torch.long),
                masked_positions=torch.randint(1, SEQ - 1, (MICRO, 5), generator=generator),
                masked_labels=torch.randint(5, VOCAB, (MICRO, 5), generator=generator),
                next_sentence_label=torch.zeros(MICRO, dtype=torch.long))


@pytest.fixture(scope="module")
def counts() -> Iterator[Counts]:
    init_distributed()  # a world of one in this process (pretrain.engine)
    config = load_config(RECIPE, [f"--phase1.batch_size={MICRO * ACCUMULATION}", f"--phase1.micro_batch_size={MICRO}"])
    phase = config.phase("phase1")
    ds = phase_ds_config(config, "phase1", dp_size=1, device_type="cuda", bf16_supported=True)
    torch.manual_seed(0)
    model = build_model(bert_config("tiny", VOCAB, 64))
    engine = build_engine(model, ds, lr_schedule=build_schedule(phase, phase.steps))
    result = Counts(wrapper=type(engine.optimizer).__name__, parameters=sum(p.numel() for p in model.parameters()),
                    communication_dtype=engine.communication_data_type)
    syncs: list[int] = [0]
    reduces: list[tuple[torch.dtype, int]] = []
    accelerator, real_sync, real_all_reduce = get_accelerator(), get_accelerator().synchronize, dist.all_reduce

    def sync_spy(*args: Any, **kwargs: Any) -> Any:
        syncs[0] += 1
        return real_sync(*args, **kwargs)

    def all_reduce_spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduces.append((tensor.dtype, tensor.numel()))
        return real_all_reduce(tensor, *args, **kwargs)

    generator = torch.Generator().manual_seed(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(accelerator, "synchronize", sync_spy)
        patch.setattr(dist, "all_reduce", all_reduce_spy)
        accelerator.synchronize()  # the spy is the one DeepSpeed's code reaches
        assert syncs == [1]
        for _ in range(OPTIMIZER_STEPS):
            syncs[0] = 0
            reduces.clear()
            for _ in range(ACCUMULATION):
                engine.backward(engine(**micro_batch(generator)).loss)
                engine.step()
            result.syncs.append(syncs[0])
            result.all_reduces.append(list(reduces))
    assert engine.global_steps == OPTIMIZER_STEPS
    yield result


def test_the_shipped_gpu_engine_is_the_bf16_optimizer_path(counts: Counts) -> None:
    assert counts.wrapper == "BF16_Optimizer"


def test_no_device_synchronisation_per_micro_batch(counts: Counts) -> None:
    # DeepSpeed's default throughput timer: 0, 0, then 2 per micro-batch (8 per step) from the third step on
    assert counts.syncs == [0] * OPTIMIZER_STEPS


def test_the_accumulated_gradient_is_all_reduced_in_fp32(counts: Counts) -> None:
    assert counts.communication_dtype == torch.float32
    for step, calls in enumerate(counts.all_reduces):
        gradient = [call for call in calls if call[1] >= counts.parameters // 2]  # the boundary all-reduce
        assert gradient and all(dtype == torch.float32 for dtype, _ in gradient), (step, calls)
        assert sum(numel for _, numel in gradient) == counts.parameters  # the whole gradient, every element
