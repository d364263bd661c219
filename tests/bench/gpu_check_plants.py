"""Planted self-tests for bench/gpu_check's contained runs and part budgets. Module-level, so that a spawned child
process (pretrain/device_check/contained.py) imports them by name; light imports, so that the child starts fast."""

from __future__ import annotations

import os
import signal
import time

import torch

from pretrain.device_check.run_shape import RunShape
from pretrain.device_check.unpadded_check import kernel_self_test
from pretrain.device_check.verdict import SelfTestResult


def segfault_in_bf16(device: torch.device, precision: str, head_dim: int, seq_len: int,
                     shape: RunShape | None = None) -> SelfTestResult:
    """In bf16, a kernel test whose process dies of SIGSEGV, as one does on a device fault (an illegal memory access
    in a kernel, which leaves a CUDA context no later call can use); in another precision the real test."""
    if precision != "bf16":
        return kernel_self_test(device, precision, head_dim, seq_len, shape)
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)  # never reached: the signal ends the process
    return SelfTestResult(True, f"{device} {precision}")


def hangs(device: torch.device, precision: str, head_dim: int, seq_len: int,
          shape: RunShape | None = None) -> SelfTestResult:
    """A kernel test that does not end (a kernel spinning, a compile that never returns)."""
    time.sleep(600)
    return SelfTestResult(True, f"{device} {precision}")
