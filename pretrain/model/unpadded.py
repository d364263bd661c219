"""The encoder on the real tokens only: transformers' own BERT modules, run on the flat tokens [1, T, hidden].

`unpadded_encode` embeds the flat tokens of an unpadded micro-batch (pretrain/data/unpadded.py),
runs every encoder layer on them and pools each instance's [CLS]. No padding token goes through a matmul
(only the bucket tail of < 64 tokens), and attention is confined to each instance by a variable-length
kernel (pretrain/model/varlen_attention.py), so no seq x seq mask exists.

Same modules, same parameters, same names: the layer runs the submodules transformers' `BertLayer` is
made of (query/key/value, `BertSelfOutput`, `BertIntermediate`, `BertOutput`) and only replaces the
attention between them, so a state dict is the same in both paths by construction and the padded path
stays the reference (tests/model/ compare them). `unpadded_layer` is what regional compilation compiles
(pretrain/model/compiled.py): one function for every layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint
from transformers import BertForPreTraining
from transformers.models.bert.modeling_bert import BertLayer

from pretrain.model.varlen_attention import VarlenKernel, varlen_attention

LayerForward = Callable[[BertLayer, torch.Tensor, torch.Tensor, int], torch.Tensor]
# another layer function set on the model, if any: the compiled layer (pretrain/model/compiled.py), or the kernel
# self-test's layer with the kernel under test (pretrain/device_check/unpadded_check.py)
LAYER_FORWARD_ATTRIBUTE = "unpadded_layer_forward"


class LayerFellBack(Exception):
    """Raised by a layer function that gave up its compiled code during this call and runs eager from now on
    (pretrain/model/compiled.py): call it again. Why not run eager in the same call: the compiled attempt's saved
    tensors may already sit in an activation-checkpointing frame (its saved-tensor hooks pack what any op saves),
    and the frame's recomputation in backward, eager only, would then save fewer tensors than the forward did
    (torch's CheckpointError). Called again from `encoder_layer`, the eager call gets a fresh frame of its own."""


def unpadded_layer(layer: BertLayer, hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                   kernel: VarlenKernel = varlen_attention) -> torch.Tensor:
    """`BertLayer.forward` on [1, T, hidden] flat tokens, with variable-length self-attention.

    [1, T, hidden] rather than [T, hidden]: every layer then gets a tensor that is nobody's view (the
    embeddings' output, the previous layer's), so the compiled layer's guards hold for all of them.
    `kernel`: the attention kernel (the device's by default; the self-test's seam for a planted wrong one)."""
    attention = layer.attention.self
    tokens = hidden.size(1)
    heads = (tokens, attention.num_attention_heads, attention.attention_head_size)
    q = attention.query(hidden).view(heads)
    k = attention.key(hidden).view(heads)
    v = attention.value(hidden).view(heads)
    dropout = attention.dropout.p if attention.training else 0.0  # as BertSelfAttention hands it to SDPA
    context = kernel(q, k, v, cu_seqlens, max_seqlen, dropout, attention.scaling).reshape(1, tokens, -1)
    attention_output = layer.attention.output(context, hidden)
    return layer.output(layer.intermediate(attention_output), attention_output)


def check_layers_supported(model: BertForPreTraining) -> None:
    """The unpadded layer implements the encoder BERT pretraining uses: no decoder, cross-attention or chunking."""
    config = model.config
    if config.is_decoder or config.add_cross_attention:
        raise ValueError("model.attention=unpadded: a decoder BERT (is_decoder / add_cross_attention) is not "
                         "supported; model.attention=padded runs it")


def unpadded_encode(
    model: BertForPreTraining, input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor, max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence output [1, T, hidden], pooled [CLS] of each instance [instances, hidden]).

    With activation checkpointing on (transformers' `gradient_checkpointing_enable`), each layer is
    recomputed in backward, as the padded path does; the RNG state is replayed, so dropout matches."""
    bert = model.bert
    hidden = bert.embeddings(input_ids=input_ids[None], token_type_ids=token_type_ids[None],
                             position_ids=position_ids[None])
    forward: LayerForward = getattr(model, LAYER_FORWARD_ATTRIBUTE, None) or unpadded_layer
    for layer in bert.encoder.layer:
        hidden = encoder_layer(forward, layer, hidden, cu_seqlens, max_seqlen)
    cls_states = hidden[0].index_select(0, cu_seqlens[:-2].long())  # each instance's first token; not the tail
    pooled = bert.pooler(cls_states[:, None, :]) if bert.pooler is not None else cls_states
    return hidden, pooled


def encoder_layer(forward: LayerForward, layer: BertLayer, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int) -> torch.Tensor:
    """`forward` on one layer, in a checkpoint frame where activation checkpointing is on; once more, from a new
    frame, when `forward` fell back to eager during the call (LayerFellBack: the first frame is dropped with the
    compiled attempt's output, so nothing of it reaches the loss)."""
    try:
        return _layer_call(forward, layer, hidden, cu_seqlens, max_seqlen)
    except LayerFellBack:
        pass  # retried below, outside the handler: the failed frame and its traceback are released first
    return _layer_call(forward, layer, hidden, cu_seqlens, max_seqlen)


def _layer_call(forward: LayerForward, layer: BertLayer, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
    if layer.gradient_checkpointing and layer.training:
        return checkpoint(forward, layer, hidden, cu_seqlens, max_seqlen, use_reentrant=False)
    return forward(layer, hidden, cu_seqlens, max_seqlen)
