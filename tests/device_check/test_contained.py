"""pretrain/device_check/contained.py: the device self-test in a child process, so that a device fault ends the child and
not the rank's context. Run on the CPU here with real children (spawned, as on a GPU; the real tests' verdicts
coming back whole from one child: tests/device_check/test_host_check.py): a child that dies of SIGABRT (what a sticky CUDA error can end in) or never answers is a
failed test in one line, and the process that asked goes on (it runs the test itself afterwards)."""

from __future__ import annotations

import torch

from pretrain.device_check.contained import contained, in_child
from pretrain.device_check.unpadded_check import kernel_self_test
from tests.support.device_faults import dies_of_a_device_fault, never_answers

CPU = torch.device("cpu")


def test_a_child_that_dies_of_a_device_fault_is_a_failed_test_and_the_rank_goes_on() -> None:
    verdict = in_child(dies_of_a_device_fault, CPU, "bf16", 16, 32, where="cuda:0 bf16")
    assert not verdict.passed
    assert verdict.numbers() == ("cuda:0 bf16: the test's process died of SIGABRT (a device fault, "
                                 "kept out of the rank's own context)")
    assert kernel_self_test(CPU, "fp32", 16, 32).passed  # this process is whole


def test_a_child_with_no_verdict_in_time_is_killed_and_the_test_failed() -> None:
    verdict = in_child(never_answers, CPU, "bf16", 16, 32, where="cuda:0 bf16", limit_s=1.0)
    assert not verdict.passed and verdict.failure == "no verdict in 1 s: its process was killed"
    assert verdict.numbers() == "cuda:0 bf16: the test gave no verdict in 1 s: its process was killed"


def test_on_the_cpu_the_test_runs_in_this_process() -> None:
    """No context to poison, and no child's start to pay: `contained` is the test itself off CUDA (a planted abort
    here would end this process, so a real test stands in: the same verdict as called directly)."""
    assert contained(kernel_self_test)(CPU, "fp32", 16, 32).numbers().split(", ")[:2] == \
        kernel_self_test(CPU, "fp32", 16, 32).numbers().split(", ")[:2]
