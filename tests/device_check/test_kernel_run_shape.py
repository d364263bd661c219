"""The kernel stage covers the run's shapes (pretrain/device_check/kernel_check.py with pretrain/device_check/run_shape.py): one more
case with the run's head count and micro-batch of instances. Planted: a kernel 10 % off only past 8 segments (the
bucket tail counted), and one 10 % off only past 2 heads; the edge cases alone (2 heads, at most 7 segments) pass
both, as the first version did (a run then trained on them, compiled too); with the run's shape both fail, in bf16,
and the correct kernel passes. CPU reference kernel, head 32, seq 64, a micro-batch of 16 instances with 4 heads."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pretrain.device_check.run_shape import RunShape, micro_batch_lengths
from pretrain.device_check.unpadded_check import kernel_self_test
from pretrain.model.varlen_attention import reference_varlen_attention

CPU = torch.device("cpu")
SEQ, HEAD = 64, 32
RUN = RunShape(heads=4, hidden=4 * HEAD, intermediate=16 * HEAD, attention_dropout=0.1, hidden_dropout=0.1,
               lengths=micro_batch_lengths(SEQ, 16))

Kernel = Callable[..., torch.Tensor]


def wrong_past(segments: int = 10**9, heads: int = 10**9) -> Kernel:
    """The reference kernel, 10 % too large when the micro-batch has more than `segments` segments (the tail
    included) or q more than `heads` heads: a kernel path taken only at a run's shapes."""
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
               dropout: float, scale: float) -> torch.Tensor:
        out = reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
        return out * 1.1 if cu_seqlens.numel() - 1 > segments or q.size(1) > heads else out

    return kernel


def test_a_kernel_wrong_only_past_8_segments_or_2_heads_fails_at_the_run_shape() -> None:
    assert len(RUN.lengths) + 1 > 8 and RUN.heads > 2
    for name, kernel in {"past 8 segments": wrong_past(segments=8), "past 2 heads": wrong_past(heads=2)}.items():
        blind = kernel_self_test(CPU, "bf16", HEAD, SEQ, kernel=kernel)  # the edge cases alone: it passes
        assert blind.passed, (name, blind.numbers())
        caught = kernel_self_test(CPU, "bf16", HEAD, SEQ, RUN, kernel=kernel)
        assert not caught.passed and caught.kernel_error > 10 * caught.kernel_limit, (name, caught.numbers())
        assert caught.numbers().startswith("cpu bf16: kernel error "), caught.numbers()
    correct = kernel_self_test(CPU, "bf16", HEAD, SEQ, RUN)
    assert correct.passed and correct.kernel_error < correct.kernel_limit / 1.3, correct.numbers()


def test_the_run_micro_batch_has_the_runs_segment_count_and_short_and_full_instances() -> None:
    for seq_len, micro in ((128, 64), (512, 16)):
        lengths = micro_batch_lengths(seq_len, micro)
        assert len(lengths) == micro and max(lengths) == seq_len and min(lengths) >= seq_len // 4
        assert any(n < seq_len // 2 for n in lengths)  # a document's end: short segments next to full rows
