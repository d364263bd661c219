"""ExactLamb (`pretrain.optim.lamb`): its math against the textbook LAMB of pretrain/optim/lamb_reference.py, param
groups, state round trip, layout pieces."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from pretrain.optim.lamb import ExactLamb, UnboundZeroLayoutError, weight_decay_param_groups
from pretrain.optim.lamb_reference import NaiveLamb
from pretrain.optim.zero_layout import partition_from_ranges

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]


def reference_run(
    weights: list[np.ndarray],
    grads_per_step: list[list[np.ndarray]],
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    **options: object,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Final weights and last trust ratios of the textbook LAMB (pretrain/optim/lamb_reference.py) in float64."""
    params = [nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in weights]
    opt = NaiveLamb(params, lr=lr, betas=(b1, b2), eps=eps, **options)
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return [p.detach().numpy() for p in params], opt.last_trust_ratios().numpy()


CASES = [
    dict(wd=0.01, bias_correction=True, trust_clip=None, adapt_all=True),
    dict(wd=0.0, bias_correction=True, trust_clip=None, adapt_all=True),
    dict(wd=0.1, bias_correction=False, trust_clip=None, adapt_all=True),
    dict(wd=0.01, bias_correction=True, trust_clip=(0.5, 1.2), adapt_all=True),
    dict(wd=0.0, bias_correction=True, trust_clip=None, adapt_all=False),  # NVIDIA style: no ratio at wd 0
    dict(wd=0.01, bias_correction=True, trust_clip=None, adapt_all=False),  # wd != 0: ratio still applies
]


@pytest.mark.parametrize("scratch", [True, False], ids=["in_place", "foreach"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_textbook_reference_over_steps(case: dict, scratch: bool) -> None:
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s) for s in SHAPES]
    weights[-1][:] = 0.0  # ||w|| = 0 -> ratio 1
    steps = [[rng.standard_normal(s) * (0.1 + k) for s in SHAPES] for k in range(5)]
    hyper = dict(lr=0.05, b1=0.9, b2=0.99, eps=1e-6)
    ref_w, ref_ratios = reference_run(
        weights,
        steps,
        **hyper,
        weight_decay=case["wd"],
        bias_correction=case["bias_correction"],
        trust_clip=case["trust_clip"],
        adapt_all=case["adapt_all"],
    )
    params = [nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in weights]
    opt = ExactLamb(
        params,
        lr=hyper["lr"],
        betas=(hyper["b1"], hyper["b2"]),
        eps=hyper["eps"],
        weight_decay=case["wd"],
        bias_correction=case["bias_correction"],
        trust_clip=case["trust_clip"],
        adapt_all=case["adapt_all"],
        scratch_buffers=scratch,
    )
    for grads in steps:
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    for p, expected in zip(params, ref_w, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(opt.last_trust_ratios().double().numpy(), ref_ratios, rtol=1e-6)
    assert not np.allclose(ref_w[0], weights[0])  # the run moved the weights
    stats = opt.trust_ratio_stats()
    if case["wd"] or case["adapt_all"]:
        assert stats["min"] <= stats["mean"] <= stats["max"]
    else:  # no tensor gets a ratio: nothing to log
        assert stats == {}


def test_float32_matches_textbook_reference() -> None:
    rng = np.random.default_rng(1)
    weights = [rng.standard_normal(s).astype(np.float32) for s in SHAPES[:3]]
    steps = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES[:3]] for _ in range(4)]
    ref_w, _ = reference_run(
        [w.astype(np.float64) for w in weights], steps, 0.02, 0.9, 0.999, 1e-6, weight_decay=0.01
    )
    params = [nn.Parameter(torch.tensor(w)) for w in weights]
    opt = ExactLamb(params, lr=0.02)
    for grads in steps:
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.tensor(g)
        opt.step()
    for p, expected in zip(params, ref_w, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), expected, atol=1e-6)


def _train(opt: ExactLamb, params: list[nn.Parameter], seeds: range) -> None:
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_state_dict_round_trip_continues_identically() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES[:3]]
    opt = ExactLamb(
        [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.01, trust_clip=(0.1, 5.0)
    )
    _train(opt, params, range(3))
    saved_state = copy.deepcopy(opt.state_dict())  # state_dict() shares the live buffers
    saved_weights = [p.detach().clone() for p in params]
    _train(opt, params, range(3, 6))
    expected = [p.detach().clone() for p in params]

    restored = [nn.Parameter(w.clone()) for w in saved_weights]
    opt2 = ExactLamb([{"params": restored[:2]}, {"params": restored[2:], "weight_decay": 0.0}], lr=0.5)
    opt2.load_state_dict(saved_state)
    assert opt2.param_groups[0]["lr"] == 0.01 and opt2.param_groups[0]["trust_clip"] == (0.1, 5.0)
    _train(opt2, restored, range(3, 6))
    for p, e in zip(restored, expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.bias_like_name = nn.Parameter(torch.zeros(4))  # a weight named like a bias: still decayed
        self.head_bias = nn.Linear(4, 4, bias=False)  # "bias" in the module name, no bias parameter


def test_weight_decay_groups_by_module_type() -> None:
    model = nn.Sequential(Block(), nn.Embedding(5, 4))
    model[0].proj.weight.requires_grad_(False)  # frozen params are left out
    decay, no_decay = weight_decay_param_groups(model, 0.02)
    assert decay["weight_decay"] == 0.02 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == [
        "0.bias_like_name",
        "0.head_bias.weight",
        "1.weight",
    ]
    assert sorted(names[id(p)] for p in no_decay["params"]) == ["0.norm.bias", "0.norm.weight", "0.proj.bias"]


def test_weight_decay_groups_on_hf_bert_with_tied_embeddings() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    model = transformers.BertForPreTraining(config)
    groups = weight_decay_param_groups(model, 0.01)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert len(grouped) == len(set(grouped)) == len(list(model.parameters()))  # tied decoder weight once
    no_decay = {n for n, p in model.named_parameters() if any(p is q for q in groups[1]["params"])}
    assert "bert.embeddings.LayerNorm.weight" in no_decay
    assert "cls.predictions.bias" in no_decay  # the MLM head's own bias parameter
    assert all(n.endswith("bias") or "LayerNorm" in n for n in no_decay)
    assert not any(
        n.endswith("bias") or "LayerNorm" in n
        for n, p in model.named_parameters()
        if any(p is q for q in groups[0]["params"])
    )


def test_unbound_flat_tensor_is_refused() -> None:
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))]
    opt = ExactLamb(params, lr=0.1)
    flat = torch.cat([p.detach() for p in params]).requires_grad_()
    flat.grad = torch.ones_like(flat)
    opt.param_groups[0]["params"] = [flat]  # what a ZeRO wrapper does to the group
    with pytest.raises(UnboundZeroLayoutError, match="bind_zero_layout"):
        opt.step()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(trust_clip=(2.0, 1.0)), "trust_clip"),
        (dict(trust_clip="wide"), "trust_clip"),
    ],
)
def test_bad_hyper_parameters_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ExactLamb([nn.Parameter(torch.zeros(2))], **kwargs)


def test_partition_pieces_skip_padding_and_reject_overlap() -> None:
    part = partition_from_ranges(
        10, [(2, 6, 3), (0, 0, 4)], num_params=3, process_group=None, ratio_key=0, reduce_device=None
    )
    assert part.piece_sizes == [4, 2, 3, 1] and part.param_indices == [0, 2]
    flat = torch.arange(10.0)
    assert [s.tolist() for s in part.segments_of(flat)] == [[0, 1, 2, 3], [6, 7, 8]]
    with pytest.raises(ValueError, match="overlaps"):
        partition_from_ranges(10, [(0, 0, 5), (1, 4, 2)], 2, None, 0, None)
    with pytest.raises(UnboundZeroLayoutError, match="rebind"):
        part.segments_of(torch.zeros(11))


def test_logged_trust_ratio_stats_leave_out_groups_without_ratios() -> None:
    """Under the default adapt_all=False the no-decay group's ratios are fixed 1s: the logged min/mean/max and
    the histogram cover the adapted tensors only, so they show what LAMB actually did."""
    torch.manual_seed(0)
    decay, no_decay = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.zeros(8))
    opt = ExactLamb([{"params": [decay], "weight_decay": 0.01}, {"params": [no_decay], "weight_decay": 0.0}], lr=0.1)
    for _ in range(2):
        decay.grad, no_decay.grad = torch.randn(8, 4) * 1e-3, torch.randn(8)
        opt.step()
    everything, adapted = opt.last_trust_ratios(), opt.last_trust_ratios(adapted_only=True)
    assert everything.numel() == 2 and adapted.numel() == 1 and everything[1] == 1.0
    stats = opt.trust_ratio_stats()
    assert stats["min"] == stats["max"] == pytest.approx(float(adapted[0])) and stats["mean"] != 1.0
