"""A device self-test's verdict: passed or not, its figures against their limits, and its lines in words.

Apart from the tests that give it, so that what carries a verdict (the child process's pipe, the ranks' JSON
gather, the run folder's cache: pretrain/device_check/host_check.py) reads it without importing the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SelfTestResult:
    """The verdict and its numbers (the worst micro-batch's relative errors against the fp32 padded reference)."""

    passed: bool
    where: str  # device and dtype, e.g. "cuda:0 bf16"
    logits_error: float = math.nan
    logits_limit: float = math.nan
    grads_error: float = math.nan
    grads_limit: float = math.nan
    seconds: float = 0.0
    failure: str | None = None  # the kernel raised: its error in one line
    kernel_error: float = math.nan  # stage 1: the kernel alone, its worst part's error (module docstring)
    kernel_limit: float = math.nan
    kernel_part: str = ""  # which: output | dq | dk | dv
    problem: str | None = None  # a failed check with no error raised: the dropout smoke check, a compile fallback
    output_name: str = "logits"  # what logits_error measures (the compiled-layer check: the layer's output)
    subject: str = "the unpadded path"  # what ran the test's code (the compiled-layer check: the compiled layer)
    cached: bool = False  # read from the run folder: an earlier launch's test on this host, same key (host_check.py)

    def numbers(self) -> str:
        """The verdict's line: where, then why it failed (first, when it did), then the numbers. The kernel stage's
        figures carry three digits: its bf16 limit is 6.25e-3, which one digit would print as a passing-looking
        6.3e-03 beside an error of 6.3e-03 that failed."""
        if self.failure is not None:  # an error, or how the test's child process ended (contained.py)
            if self.failure.startswith("its process"):
                return f"{self.where}: the test's {self.failure.removeprefix('its ')}"
            if self.failure.startswith("no verdict"):
                return f"{self.where}: the test gave {self.failure}"
            return f"{self.where}: {self.subject} raised {self.failure}"
        kernel = ("" if math.isnan(self.kernel_error) else
                  f"kernel error {self.kernel_error:.2e} ({self.kernel_part}; limit {self.kernel_limit:.2e}), ")
        why = self.reason()
        return (f"{self.where}: {f'{why}; ' if why else ''}{kernel}{self.output_name} error {self.logits_error:.1e} "
                f"(limit {self.logits_limit:.1e}), gradients {self.grads_error:.1e} (limit {self.grads_limit:.1e}), "
                f"{self.seconds:.1f} s")

    def reason(self) -> str | None:
        """Why the verdict failed, in words: each figure over its limit (the kernel stage's first), then the check
        that failed with no figure (dropout, a fallback); None when nothing failed."""
        figures = (("kernel error", self.kernel_error, self.kernel_limit),
                   (f"{self.output_name} error", self.logits_error, self.logits_limit),
                   ("gradients error", self.grads_error, self.grads_limit))
        reasons = [f"{name} {error:.2e} is over its limit {limit:.2e}" for name, error, limit in figures
                   if not math.isnan(limit) and over(error, limit) > 1]
        reasons += [self.problem] if self.problem is not None else []
        return "; ".join(reasons) or None


def over(error: float, limit: float) -> float:
    """How far past its limit an error is (> 1: failed); NaN is infinitely far."""
    return error / limit if error == error else math.inf
