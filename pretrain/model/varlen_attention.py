"""Variable-length attention over flat tokens: the CUDA flash kernel, the CPU reference, and what each needs.

Both take q, k, v as [T, heads, head_dim] (the flat tokens of pretrain/data/unpadded.py), the
segment bounds `cu_seqlens` [segments + 1] int32 and an upper bound `max_seqlen` of a segment's length,
and return [T, heads, head_dim]: each token attends to the keys of its own segment only.

CUDA: `torch.ops.aten._flash_attention_forward` (FlashAttention-2's varlen kernel inside torch). Chosen
over `torch.nn.attention.varlen.varlen_attn` (the same kernel, but its dropout is hard-coded to 0.0,
and BERT's `attention_probs_dropout_prob` is 0.1) and FlexAttention with a document mask (no dropout
either). It has autograd (its backward replays the dropout from the returned RNG state) and a meta
kernel, so dynamo traces it; no seq x seq mask exists anywhere. It needs bf16/fp16, a head size that is
a multiple of 8 up to 256, and an sm80+ GPU: pretrain/model/kernel_support.py says what is missing, before
launch, and the kernel self-test (pretrain/device_check/unpadded_check.py) checks it on the device before training.

CPU (and any non-CUDA device): the reference. The flat tokens are scattered into [segments, max_seqlen]
rows with an index computed from `cu_seqlens` by fixed-shape ops (no data-dependent shape, no host sync,
traceable with no graph break), SDPA runs with a key-padding mask and the dropout, and the real tokens
are gathered back. It computes what the padded path computes, row for row: that is what CI tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# q, k, v, cu_seqlens, max_seqlen, dropout, scale -> [T, heads, head_dim]: what `unpadded_layer` calls
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, float], torch.Tensor]


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, dropout: float, scale: float) -> torch.Tensor:
    """The CUDA kernel (module docstring): contiguous [T, heads, head_dim] in, same out."""
    output = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout, False, False, scale=scale,
    )[0]
    return output


def segment_index(cu_seqlens: torch.Tensor, tokens: int, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row * max_seqlen + offset of each flat token, [segments, max_seqlen] True at real keys).

    Fixed shapes from `tokens`, `max_seqlen` and cu_seqlens' length alone. Column 0 of every row counts as a
    key even in an empty segment (an empty tail), so no row is fully masked (SDPA would give NaN there);
    no real token reads such a row."""
    bounds = cu_seqlens.long()
    flat = torch.arange(tokens, device=cu_seqlens.device)
    row = torch.searchsorted(bounds[1:], flat, right=True)
    index = row * max_seqlen + (flat - bounds[row])
    lengths = (bounds[1:] - bounds[:-1]).clamp_min(1)
    keys = torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]
    return index, keys


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               max_seqlen: int, dropout: float, scale: float) -> torch.Tensor:
    """The reference kernel (module docstring): scatter to rows, SDPA with a key-padding mask, gather back."""
    tokens, heads, head_dim = q.shape
    segments = cu_seqlens.numel() - 1
    index, keys = segment_index(cu_seqlens, tokens, max_seqlen)

    def rows(x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(segments * max_seqlen, heads, head_dim).index_copy(0, index, x)
        return padded.view(segments, max_seqlen, heads, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=keys[:, None, None, :],
                                         dropout_p=dropout, scale=scale)
    return out.transpose(1, 2).reshape(segments * max_seqlen, heads, head_dim).index_select(0, index)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, dropout: float, scale: float) -> torch.Tensor:
    """The kernel of q's device: flash on CUDA, the reference elsewhere (checked at launch: kernel_support.py)."""
    kernel = flash_varlen_attention if q.is_cuda else reference_varlen_attention
    return kernel(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
