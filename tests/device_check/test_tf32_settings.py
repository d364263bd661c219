"""The self-test in a process that set TF32 through torch's new API (pretrain/device_check/kernel_check.py `exact_fp32`):
`torch.backends.fp32_precision = "tf32"` (what transformers' enable_tf32 sets on torch >= 2.9) made torch 2.13 raise
on the test's read of the legacy allow_tf32 flags ("mix of the legacy and new APIs"), so the test failed and `auto`
ran padded. Now it passes, and the process's settings are what they were, both ways of setting them."""

from __future__ import annotations

import torch

from pretrain.device_check.unpadded_check import kernel_self_test

CPU = torch.device("cpu")


def test_tf32_set_through_the_new_api_passes_the_self_test_and_is_kept() -> None:
    try:
        torch.backends.fp32_precision = "tf32"
        result = kernel_self_test(CPU, "bf16", 16, 32)
        assert result.passed and result.failure is None, result.numbers()
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision) == ("tf32", "tf32")
    finally:
        # the legacy flags readable again for the rest of the session
        torch.backends.fp32_precision = torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.cudnn.fp32_precision = "none"
    legacy = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True  # the legacy way: kept as well
        assert kernel_self_test(CPU, "bf16", 16, 32).passed
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
