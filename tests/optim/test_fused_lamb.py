"""The fused (torch.compile'd) flat-partition LAMB step equals the reference multi-tensor step.

Tolerance (documented in pretrain/optim/fused_lamb.py): weights and moments rtol 1e-5 / atol 1e-7 (O(1) values) after
several steps, trust ratios rtol 1e-6. On CPU the compiled kernels are inductor's C++ backend.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pretrain.optim.fused_lamb import FusedKernels
from pretrain.optim.lamb import ExactLamb
from pretrain.optim.zero_layout import ZeroLayout, partition_from_ranges

SHAPES = [(37, 5), (11,), (64, 3), (7, 7), (5,)]
Ranges = list[tuple[int, int, int]]  # (parameter index, start, length) inside a flat partition


def flat_setup(gap: int = 3) -> tuple[list[torch.Tensor], list[Ranges]]:
    """Two flat 'partitions' like ZeRO's: parameters back to back with alignment gaps, one per group."""
    generator = torch.Generator().manual_seed(0)
    flats, all_ranges = [], []
    for shapes in (SHAPES[:3], SHAPES[3:]):
        ranges, cursor = [], 0
        for index, shape in enumerate(shapes):
            numel = int(torch.Size(shape).numel())
            ranges.append((index, cursor, numel))
            cursor += numel + gap
        flat = torch.zeros(cursor)
        for _, start, numel in ranges:
            flat[start : start + numel] = torch.randn(numel, generator=generator)
        flats.append(flat)
        all_ranges.append(ranges)
    return flats, all_ranges


def segment_mask(flat: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    mask = torch.zeros_like(flat, dtype=torch.bool)
    for _, start, numel in ranges:
        mask[start : start + numel] = True
    return mask


def lamb_on_flats(flats: list[torch.Tensor], all_ranges: list[Ranges], fused: bool, **options: object) -> ExactLamb:
    """ExactLamb handed flat partitions the way DeepSpeed's ZeRO wrappers hand them, with their layout."""
    optimizer = ExactLamb([{"params": [torch.empty(0)], "weight_decay": 0.01}, {"params": [torch.empty(0)],
                      "weight_decay": 0.0}], lr=0.02, fused=fused, **options)
    for group, flat in zip(optimizer.param_groups, flats, strict=True):
        group["params"] = [flat]
    optimizer.set_zero_layout(ZeroLayout(wrapper="test", partitions={
        id(flat): partition_from_ranges(flat.numel(), ranges, len(ranges), None, key, None)
        for key, (flat, ranges) in enumerate(zip(flats, all_ranges, strict=True))
    }))
    return optimizer


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="inductor CPU needs a C compiler")
@pytest.mark.parametrize("options", [
    {"adapt_all": True, "trust_clip": None},
    {"adapt_all": False, "trust_clip": (0.0, 5.0), "bias_correction": False},
])
def test_fused_flat_step_equals_reference(options: dict) -> None:
    flats, all_ranges = flat_setup()
    reference_flats = [f.clone() for f in flats]
    fused_flats = [f.clone() for f in flats]
    reference = lamb_on_flats(reference_flats, all_ranges, fused=False, **options)
    fused = lamb_on_flats(fused_flats, all_ranges, fused=True, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        for ref_flat, fused_flat, ranges in zip(reference_flats, fused_flats, all_ranges, strict=True):
            # gaps carry zero gradient, as in ZeRO's padded gradient partitions
            grad = torch.randn(ref_flat.shape, generator=generator) * segment_mask(ref_flat, ranges)
            ref_flat.grad, fused_flat.grad = grad.clone(), grad.clone()
        reference.step()
        fused.step()
    assert fused._fused_kernels is not None and fused._fused_kernels.compiled  # really the compiled path
    for ref_flat, fused_flat in zip(reference_flats, fused_flats, strict=True):
        torch.testing.assert_close(fused_flat, ref_flat, rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[fused_flat][key], reference.state[ref_flat][key],
                                       rtol=1e-5, atol=1e-7)  # gradients are O(1): fp32 rounding of lerp
    torch.testing.assert_close(fused.last_trust_ratios(), reference.last_trust_ratios(), rtol=1e-6, atol=0.0)
    for original, fused_flat, ranges in zip(flats, fused_flats, all_ranges, strict=True):
        inside = segment_mask(original, ranges)
        assert torch.equal(fused_flat[~inside], original[~inside])  # gaps belong to no parameter: untouched
        assert not torch.equal(fused_flat[inside], original[inside])


def test_fused_argument_is_validated() -> None:
    with pytest.raises(ValueError, match="fused must be null, true or false"):
        ExactLamb([torch.zeros(2, requires_grad=True)], fused="yes")  # type: ignore[arg-type]


def test_separate_parameters_take_the_reference_step_even_when_fused() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused, reference = ExactLamb(params, lr=0.1, fused=True), ExactLamb(twins, lr=0.1, fused=False)
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    fused.step()
    reference.step()
    assert fused._fused_kernels is None
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p, q)
    copy.deepcopy(fused.state_dict())  # the state stays a plain torch optimizer state


@pytest.mark.parametrize("compiled", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                                reason="inductor CPU needs a C compiler")),
])
def test_fused_step_of_a_bf16_partition_computes_with_fp32_scalars(compiled: bool) -> None:
    """A bf16 flat (DeepSpeed's bf16_master_weights_and_grads) stepped by the fused kernels equals the fp32
    reference step on the same values. Scalars cast to bf16 would not: beta2 = 0.999 becomes 1.0 (v stops
    decaying) and 1 - beta1 = 0.1 becomes 0.10009766, which moves every trust ratio by ~1e-3."""
    assert torch.tensor(0.999, dtype=torch.bfloat16).item() == 1.0  # what the old cast did to beta2
    flats, all_ranges = flat_setup()
    low = [f.bfloat16() for f in flats]
    exact = [f.float() for f in low]  # the same values in fp32: the reference math
    generator = torch.Generator().manual_seed(2)
    fused = lamb_on_flats(low, all_ranges, fused=True)
    reference = lamb_on_flats(exact, all_ranges, fused=False)
    if not compiled:
        fused._fused_kernels = FusedKernels(compiled=False, strict=True)  # the same flat math, eager
    for low_flat, exact_flat, ranges in zip(low, exact, all_ranges, strict=True):
        inside = segment_mask(exact_flat, ranges)
        # a mid-training state (step 3) whose second moment dwarfs the new g*g: the step is mostly beta2 * v
        m = (torch.randn(exact_flat.shape, generator=generator) * inside).bfloat16()
        v = ((torch.rand(exact_flat.shape, generator=generator) + 0.5) * inside).bfloat16()
        grad = (torch.randn(exact_flat.shape, generator=generator) * 0.1 * inside).bfloat16()
        fused.state[low_flat] = {"step": 3, "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        reference.state[exact_flat] = {"step": 3, "exp_avg": m.float(), "exp_avg_sq": v.float()}
        low_flat.grad, exact_flat.grad = grad, grad.float()
    fused.step()
    reference.step()
    assert fused._fused_kernels is not None and fused._fused_kernels.compiled == compiled
    # the trust ratios see the fp32 direction and fp32 norms: fp32 agreement, far inside the 1e-3 of a bf16 cast
    torch.testing.assert_close(fused.last_trust_ratios(), reference.last_trust_ratios(), rtol=1e-5, atol=0.0)
    for low_flat, exact_flat, original, ranges in zip(low, exact, flats, all_ranges, strict=True):
        assert low_flat.dtype == fused.state[low_flat]["exp_avg_sq"].dtype == torch.bfloat16
        # stored values: the fp32 result rounded once to bf16 (within one bf16 ulp of it)
        torch.testing.assert_close(low_flat.float(), exact_flat, rtol=2**-8, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[low_flat][key].float(), reference.state[exact_flat][key],
                                       rtol=2**-8, atol=1e-6)
        inside = segment_mask(original, ranges)
        assert torch.equal(low_flat[~inside], original[~inside].bfloat16())  # gaps untouched


class HostDataTensors(TorchFunctionMode):
    """Counts tensors made from Python data (`torch.tensor([...], device=...)` and kin), passing every call
    through. On CUDA each such call is a blocking host->device copy plus a stream sync."""

    FACTORIES = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        data = args[1] if name == "new_tensor" and len(args) > 1 else (args[0] if args else None)
        if name in self.FACTORIES and not isinstance(data, torch.Tensor):
            self.calls.append(f"torch.{name}({type(data).__name__})")
        return func(*args, **(kwargs or {}))


def steady_state_host_tensors(optimizer: ExactLamb, tensors: list[torch.Tensor], steps: int = 3) -> list[str]:
    """Host-data tensors made during `steps` optimizer steps after a first (warm-up: state, caches)."""
    generator = torch.Generator().manual_seed(4)
    counter = HostDataTensors()
    for step in range(steps + 1):
        for tensor in tensors:
            tensor.grad = torch.randn(tensor.shape, generator=generator)
        if step == 0:
            optimizer.step()
            continue
        with counter:
            optimizer.step()
    return counter.calls


@pytest.mark.parametrize("path", ["fused", "flat_reference", "per_tensor_in_place", "per_tensor_foreach"])
def test_steady_state_steps_make_no_tensors_from_python_data(path: str) -> None:
    """Every step path of ExactLamb, after its first step, makes no tensor from Python lists or scalars:
    the fused step refills cached 0-d scalars and reuses the layout's cached index tensors, the trust-ratio
    scaling uses a Python scalar. (Before: 5 + 2 such tensors per partition in the fused step, 1-2 per group
    in the others.) The fused path runs its flat math uncompiled here: the host-side code is the same."""
    if path in ("fused", "flat_reference"):
        tensors, all_ranges = flat_setup()
        optimizer = lamb_on_flats(tensors, all_ranges, fused=path == "fused", adapt_all=True)
        if path == "fused":
            optimizer._fused_kernels = FusedKernels(compiled=False, strict=True)
    else:
        torch.manual_seed(0)
        tensors = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        optimizer = ExactLamb([{"params": tensors[:3]}, {"params": tensors[3:], "weight_decay": 0.0}], lr=0.02,
                              adapt_all=True, scratch_buffers=path == "per_tensor_in_place")
    before = [t.detach().clone() for t in tensors]
    assert steady_state_host_tensors(optimizer, tensors) == []
    assert all(not torch.equal(t, b) for t, b in zip(tensors, before, strict=True))  # the steps did update
    if path == "fused":
        assert optimizer._fused_kernels is not None and optimizer._fused_kernels._scalars  # the cached path ran
