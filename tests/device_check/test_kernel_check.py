"""The self-test's kernel stage (pretrain/device_check/kernel_check.py) sees a kernel 1 % off in bf16, forward or backward,
at seq 128 and 512, where the whole-model stage cannot; the correct kernel passes with margin; the edge cases are
there; a failed kernel stage fails the self-test and its line says so; the dropout smoke check catches a kernel
that ignores its dropout or forgets the rescale. Run with -s for the measured margins."""

from __future__ import annotations

import torch

from pretrain.device_check.kernel_check import dropout_problem, kernel_case, kernel_error, kernel_limit
from pretrain.device_check.unpadded_check import edge_case_lengths, kernel_self_test
from pretrain.model.varlen_attention import reference_varlen_attention
from tests.device_check.test_unpadded_check import blind_to_the_tail

CPU = torch.device("cpu")
MARGIN = 1.3  # the correct kernel stays this far under the limit, a 1 % wrong one this far over it


def one_percent_off(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                    dropout: float, scale: float) -> torch.Tensor:
    """Wrong by 1 %: the output scaled by 1.01 (a wrong normalization, say)."""
    return reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout, scale) * 1.01


def backward_one_percent_off(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                             max_seqlen: int, dropout: float, scale: float) -> torch.Tensor:
    """Right forward, dq/dk/dv 1 % off (a wrong backward kernel)."""
    out = reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    return out + 0.01 * (out - out.detach())


def test_the_cases_hold_one_segment_a_full_row_and_an_empty_tail() -> None:
    for seq in (128, 512):
        cases = [kernel_case(lengths, seq) for lengths in edge_case_lengths(seq)]
        tails = [int(c.cu_seqlens[-1]) - c.real for c in cases]
        assert tails[1] == tails[2] == 0 and tails[0] > 0  # exact buckets: the tail segment is empty
        assert cases[1].cu_seqlens.tolist() == [0, seq, seq]  # one segment filling the row
        assert all(c.max_seqlen == seq for c in cases)


def test_a_kernel_one_percent_off_in_bf16_is_caught_and_the_correct_one_passes_with_margin() -> None:
    limit = kernel_limit(torch.bfloat16)
    assert abs(limit - 0.8 * 2**-7) < 1e-12 and kernel_limit(torch.float16) < limit / 7
    for seq in (128, 512):
        batches = edge_case_lengths(seq)
        correct = kernel_error(CPU, torch.bfloat16, 64, batches, reference_varlen_attention)
        forward = kernel_error(CPU, torch.bfloat16, 64, batches, one_percent_off)
        backward = kernel_error(CPU, torch.bfloat16, 64, batches, backward_one_percent_off)
        print(f"seq {seq} bf16 head 64, limit {limit:.2e}: correct {max(correct.values()):.2e} {correct}; "
              f"output x1.01 {min(forward.values()):.2e}; backward x1.01 {max(backward.values()):.2e}")
        assert max(correct.values()) * MARGIN < limit, correct
        assert min(forward.values()) > MARGIN * limit, forward  # every part sees it
        assert backward["output"] < limit < min(backward[p] for p in ("dq", "dk", "dv")) / MARGIN, backward
    assert max(kernel_error(CPU, torch.float32, 32, edge_case_lengths(64), reference_varlen_attention).values()) == 0
    tail = kernel_error(CPU, torch.bfloat16, 32, edge_case_lengths(64), blind_to_the_tail)
    assert tail["output"] > 10 * limit  # the last instance reading the bucket tail


def test_a_failed_kernel_stage_fails_the_self_test_and_says_so() -> None:
    passed = kernel_self_test(CPU, "bf16", 32, 64)
    assert passed.passed and passed.kernel_error < passed.kernel_limit, passed.numbers()
    assert passed.numbers().startswith("cpu bf16: kernel error ")
    failed = kernel_self_test(CPU, "bf16", 32, 64, kernel=one_percent_off)
    assert not failed.passed and failed.kernel_error > failed.kernel_limit
    assert failed.logits_error <= failed.logits_limit  # the whole-model stage alone would have passed it
    assert failed.numbers().startswith("cpu bf16: kernel error 1.")  # 1.0-1.1e-02, over its limit 6.25e-03: first
    assert " is over its limit 6.25e-03; kernel error 1." in failed.numbers()


def ignoring_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     dropout: float, scale: float) -> torch.Tensor:
    """Wrong with dropout on: the dropout argument dropped (the varlen_attn API's hard-coded 0.0)."""
    return reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, 0.0, scale)


def not_rescaling(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  dropout: float, scale: float) -> torch.Tensor:
    """Wrong with dropout on: the kept probabilities not scaled by 1 / (1 - p)."""
    return reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout, scale) * (1 - dropout)


def test_the_dropout_smoke_check_passes_the_reference_and_catches_a_kernel_that_ignores_or_misscales_it() -> None:
    for seq in (64, 512):
        lengths = edge_case_lengths(seq)[0]
        assert dropout_problem(CPU, torch.bfloat16, 64, lengths, reference_varlen_attention) is None
        assert dropout_problem(CPU, torch.bfloat16, 64, lengths, ignoring_dropout) == (
            "attention dropout 0.1 changed neither the output nor the gradients")
        assert (dropout_problem(CPU, torch.bfloat16, 64, lengths, not_rescaling) or "").startswith(
            "attention dropout 0.1 moved the mean output by -")
    failed = kernel_self_test(CPU, "bf16", 32, 64, kernel=not_rescaling)
    assert not failed.passed and failed.kernel_error < failed.kernel_limit  # the numbers pass: the dropout fails
    assert failed.numbers().startswith("cpu bf16: attention dropout 0.1 moved the mean output by -")  # reason first
    assert "inverted dropout keeps it); kernel error " in failed.numbers()
