"""adapt_all: zero-initialised biases must learn from the first steps of the shipped recipe's warm-up.

With a trust ratio on a bias that starts at 0 (adapt_all=True), the first step moves it by lr * u (ratio 1
while ||b|| = 0) and every later step by lr * ||b||: it can grow only by a factor (1 + lr) per step and
stays ~0 for as long as lr is small, i.e. through the whole warm-up of BERT-Large's phase 1. The recipe's
lr and warm-up come from NVIDIA, tuned with apex FusedLAMB, which gives weight-decay-0 tensors no trust
ratio (use_nvlamb=False); so does ExactLamb by default and in every shipped DeepSpeed JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pretrain.config.deepspeed import deep_merge, phase_ds_config
from pretrain.config.load import load_config
from pretrain.engine import build_engine
from pretrain.optim.lamb import ExactLamb
from pretrain.optim.lamb_reference import NaiveLamb
from pretrain.schedules.lr import Schedule, build_schedule
from tests.support.paths import REPO_ROOT

RECIPE = REPO_ROOT / "ds_configs" / "recipes" / "bert_large_64k.json"
WIDTH, MICRO, STEPS = 16, 8, 6


def recipe_phase1(recipe: Path) -> tuple[dict[str, Any], Schedule]:
    """Phase 1's DeepSpeed dict and schedule as the driver builds them (pretrain/train.py: plan_run, run_phase)
    from the shipped recipe and its DeepSpeed JSON; only the batch is shrunk (the schedule is the recipe's)."""
    config = load_config(recipe, [f"--phase1.batch_size={MICRO}", f"--phase1.micro_batch_size={MICRO}"])
    phase = config.phase("phase1")
    schedule = build_schedule(phase, phase.steps)
    return phase_ds_config(config, "phase1", dp_size=1, device_type="cpu"), schedule


def update_sizes(ds: dict[str, Any], schedule: Schedule) -> tuple[float, float, list[float]]:
    """Mean per-element |update| of a zero-initialised bias and of its unit-scale weight over steps 2..STEPS
    (step 1 moves a zero bias by lr * u whatever adapt_all is), and the lr of each step."""
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        layer.weight.normal_(0.0, 1.0)  # rms 1: LAMB moves it by ~lr per element, like Adam moves a bias
        layer.bias.zero_()  # as transformers initialises every Linear / LayerNorm bias
    true_weight, true_bias = torch.randn(WIDTH, WIDTH), torch.randn(WIDTH)
    engine = build_engine(nn.Sequential(layer), ds, lr_schedule=schedule)
    bias_moves, weight_moves, lrs = [], [], []
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(MICRO, WIDTH, generator=generator)
        before = [p.detach().clone() for p in (layer.weight, layer.bias)]
        lrs.append(engine.get_lr()[0])
        engine.backward(nn.functional.mse_loss(engine(x), x @ true_weight.T + true_bias))
        engine.step()
        if step:
            weight_moves.append((layer.weight.detach() - before[0]).abs().mean().item())
            bias_moves.append((layer.bias.detach() - before[1]).abs().mean().item())
    return sum(bias_moves) / len(bias_moves), sum(weight_moves) / len(weight_moves), lrs


def test_shipped_recipe_moves_zero_initialised_biases_at_the_rate_of_the_weights() -> None:
    ds, schedule = recipe_phase1(RECIPE)
    bias, weight, lrs = update_sizes(ds, schedule)
    assert max(lrs) < 1e-4  # deep in the recipe's warm-up: lr 6e-3 / 2001 per step
    assert 0.25 < bias / weight < 4.0, (bias, weight)

    # The paper's algorithm read literally (adapt_all: true): the bias moves ~lr times slower than the weights.
    literal = deep_merge(ds, {"optimizer": {"params": {"adapt_all": True}}})
    bias_literal, weight_literal, _ = update_sizes(literal, schedule)
    assert 0.5 < weight_literal / weight < 2.0  # decayed weights take the same trust-ratio step either way
    assert bias_literal / weight_literal < 10 * lrs[0], (bias_literal, weight_literal)


def test_default_gives_weight_decay_zero_groups_no_trust_ratio() -> None:
    params = [nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.zeros(3))]
    for optimizer_type in (ExactLamb, NaiveLamb):  # the reference agrees on the default
        optimizer = optimizer_type([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=0.1)
        assert [group["adapt_all"] for group in optimizer.param_groups] == [False, False]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = ExactLamb([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=0.1)
    optimizer.step()
    ratios = optimizer.last_trust_ratios()
    assert ratios[1] == 1.0 and ratios[0] != 1.0  # the decayed weight keeps its ratio
    torch.testing.assert_close(params[1].detach(), torch.full((3,), -0.1), rtol=1e-5, atol=0.0)  # lr * u, u ~ 1
