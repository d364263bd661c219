"""Self-tests that fail the way a GPU can, planted for pretrain/device_check/contained.py's tests: module-level, so a
spawned child process can import them by name."""

from __future__ import annotations

import os
import time

import torch

from pretrain.device_check.verdict import SelfTestResult


def dies_of_a_device_fault(device: torch.device, precision: str, head_dim: int, seq_len: int) -> SelfTestResult:
    """What a process with a sticky CUDA error (an illegal memory access) may do: end by SIGABRT, no verdict."""
    del device, precision, head_dim, seq_len
    os.abort()


def never_answers(device: torch.device, precision: str, head_dim: int, seq_len: int) -> SelfTestResult:
    """A kernel that hangs the device."""
    del device, precision, head_dim, seq_len
    time.sleep(3600)
    raise AssertionError("unreachable")
