"""BERT for pretraining: transformers' `BertForPreTraining` with a sparse MLM head.

The module *is* a `BertForPreTraining` (same submodules, same parameter names), so a consolidated
state dict loads into the Hugging Face class unchanged. Only `forward` differs: the MLM head runs
on the masked positions alone (gathered first), which for BERT's 15% masking skips ~85% of the
largest matmul of the model (hidden x vocab).

The objective follows the shards (pretrain/plan/run_plan.py): BERT's sentence pairs train MLM + NSP; shards
packed without pairs (data_prep --segments full-sentences / doc-sentences, RoBERTa's inputs) train MLM
alone. The model config says which (`NSP_FIELD`, saved with every export): without NSP the pooler and the
NSP classifier are not built at all, so the parameters are exactly `BertForMaskedLM`'s and no untrained
head is exported as if it were trained.

The gather is fixed-size: the head runs on every slot of `masked_positions` (instances x
max_predictions rows), labelled or not, and the loss ignores the empty slots (IGNORE_INDEX). Selecting
only the labelled slots with a boolean index would give a data-dependent shape, i.e. a device -> host
sync in every micro-batch on GPU; the few empty slots (an instance rarely has fewer than
max_predictions targets) cost less than that sync.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForPreTraining

from pretrain.model.presets import PRESETS, unknown_preset
from pretrain.model.unpadded import unpadded_encode

IGNORE_INDEX = -100
NSP_FIELD = "next_sentence_prediction"  # BertConfig field: False = MLM alone (no pooler, no NSP head)
OBJECTIVES = {True: "mlm+nsp", False: "mlm"}  # how runs, reports and model cards name the two


def trains_nsp(config: BertConfig) -> bool:
    """Whether a model of this config has (and trains) BERT's pooler and next-sentence head."""
    return bool(getattr(config, NSP_FIELD, True))


def block_diagonal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[rows, seq] instance ids of packed rows -> bool [rows, 1, seq, seq], True where query and key
    belong to the same instance. Padding (id 0) sees padding only, so no query row is fully masked
    (SDPA would return NaN there); padding outputs are never read."""
    return (segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)).unsqueeze(1)

def key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[batch, seq] 1/0 padding mask -> bool [batch, 1, 1, seq] (True = a real key), or None for no padding.

    transformers hands a 4D mask to SDPA as it is; given the 2D one it first checks `mask.all()` in a
    Python `if`, a device -> host sync in every forward. Every query row still sees its own real keys."""
    if attention_mask is None or attention_mask.dim() == 4:
        return attention_mask
    return attention_mask.bool()[:, None, None, :]


def mask_for_attention(mask: torch.Tensor | None, implementation: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A 4D bool mask (True = attend) in the form the model's attention implementation reads.

    transformers hands a prepared 4D mask to the attention function unchanged: SDPA takes a bool mask as it is,
    but eager attention ADDS its mask to the scores, where a bool mask would add 0/1 and leave the padding
    unmasked. So eager gets 0 at the keys and the dtype's minimum elsewhere; an implementation that reads no
    such mask (flash_attention_2, flex_attention, ...) is refused rather than handed one it would misread."""
    if mask is None or mask.dtype != torch.bool or implementation == "sdpa":
        return mask
    if implementation == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    raise ValueError(f"the padded path builds its attention masks for sdpa or eager attention; this model's "
                     f"attn_implementation is {implementation!r}")


def bert_config(preset: str, vocab_size: int, max_position_embeddings: int = 512, next_sentence_prediction: bool = True,
                **overrides: Any) -> BertConfig:
    """A `BertConfig` from a preset name plus explicit overrides (unknown override names are errors);
    `next_sentence_prediction` False: MLM alone (module docstring), which the shards decide, never an override."""
    if preset not in PRESETS:
        raise ValueError(unknown_preset(preset))
    known = set(BertConfig().to_dict())
    for key in overrides:
        if key not in known:
            raise ValueError(f"model.overrides.{key}: not a BertConfig field")
    fields = {**PRESETS[preset], "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings}
    fields.update(overrides)
    if not next_sentence_prediction:  # recorded only when off: an NSP model's config is transformers' own
        fields[NSP_FIELD] = False
    return BertConfig(**fields)


@dataclass
class PretrainingOutput:
    """Losses and the numbers needed for accuracy, all computed on this rank's micro-batch."""

    loss: torch.Tensor  # mlm + nsp (what backward runs on)
    mlm_loss: torch.Tensor  # mean over this micro-batch's labelled slots
    nsp_loss: torch.Tensor  # 0 when the model trains MLM alone
    mlm_logits: torch.Tensor  # [instances*max_predictions, vocab]: every slot, labelled or not
    mlm_labels: torch.Tensor  # [instances*max_predictions], IGNORE_INDEX in empty slots
    nsp_logits: torch.Tensor | None  # [batch, 2]; None when the model trains MLM alone
    # Cross-entropy summed over the labelled slots: the trainer divides it by the labelled count of the whole
    # global batch, so that the gradient does not depend on how the batch is split (pretrain/trainer.py).
    mlm_loss_sum: torch.Tensor | None = None

    @property
    def mlm_mask(self) -> torch.Tensor:
        """True at the labelled slots: the only rows of `mlm_logits` that count (accuracy, distillation)."""
        return self.mlm_labels != IGNORE_INDEX

    def mlm_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(correct predictions, labelled slots), on the device: MLM accuracy without a host sync."""
        labelled = self.mlm_mask
        return ((self.mlm_logits.argmax(-1) == self.mlm_labels) & labelled).sum(), labelled.sum()


class SparseBertForPreTraining(BertForPreTraining):
    """`BertForPreTraining` whose MLM head only sees masked positions.

    `forward(input_ids, token_type_ids, attention_mask, masked_positions, masked_labels,
    next_sentence_label)`: `masked_positions` / `masked_labels` are [batch, max_predictions],
    padded with position 0 / label -100; `attention_mask` None means no padding (see
    `pretrain.data.loader.model_inputs`). Returns `PretrainingOutput`.

    Packed rows (pretrain/data/packing.py) add `segment_ids`, `position_ids` and `cls_positions`: attention
    is block-diagonal per instance and NSP pools every instance's [CLS]; `next_sentence_label` then has
    one entry per slot with -100 for empty slots (ignored by the loss, as for MLM). Packed
    `masked_positions` are [instances, max_predictions] flat indices into the rows*seq tokens, so the
    MLM head runs on as many rows as unpacked.

    Unpadded batches (pretrain/data/unpadded.py) give flat [T] `input_ids`, `token_type_ids` and
    `position_ids` with `cu_seqlens` and `max_seqlen`: the encoder runs on the real tokens alone
    (pretrain/model/unpadded.py); MLM positions are flat indices into the T tokens, NSP has one label per
    instance.

    A config with `next_sentence_prediction` False (module docstring) builds neither the pooler nor the NSP
    classifier: `next_sentence_label` then only marks the instances (shards without pairs hold -1 there).
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        if not trains_nsp(config):
            self.bert.pooler = None
            self.cls.seq_relationship = None

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
        masked_labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cls_positions: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> PretrainingOutput:
        if masked_positions is None or masked_labels is None or next_sentence_label is None:
            raise ValueError("a pretraining batch needs masked_positions, masked_labels and next_sentence_label")
        flat_positions = segment_ids is not None or cu_seqlens is not None
        if cu_seqlens is not None:
            if position_ids is None or max_seqlen is None:
                raise ValueError("unpadded batches need cu_seqlens, max_seqlen and position_ids together")
            sequence_output, pooled_output = unpadded_encode(self, input_ids, token_type_ids, position_ids,
                                                             cu_seqlens, max_seqlen)
        elif segment_ids is None:
            encoded = self.bert(input_ids=input_ids, attention_mask=self.attention_mask(key_padding_mask(attention_mask)),
                                token_type_ids=token_type_ids)
            sequence_output, pooled_output = encoded[0], encoded.pooler_output
        else:
            if position_ids is None or cls_positions is None:
                raise ValueError("packed batches need segment_ids, position_ids and cls_positions together")
            # A prepared 4D bool mask (True = attend): block-diagonal per instance, as the implementation reads it.
            encoded = self.bert(input_ids=input_ids, attention_mask=self.attention_mask(block_diagonal_mask(segment_ids)),
                                token_type_ids=token_type_ids, position_ids=position_ids)
            sequence_output = encoded[0]
            hidden = sequence_output.size(-1)
            index = cls_positions.long().unsqueeze(-1).expand(-1, -1, hidden)
            cls_states = torch.gather(sequence_output, 1, index).reshape(-1, 1, hidden)  # [rows*slots, 1, hidden]
            pooled_output = cls_states if self.bert.pooler is None else self.bert.pooler(cls_states)
        mlm_logits, labels = self.masked_lm_logits(sequence_output, masked_positions, masked_labels,
                                                   flat_positions=flat_positions)
        mlm_loss_sum = masked_lm_loss_sum(mlm_logits, labels)
        mlm_loss = mlm_loss_sum / (labels != IGNORE_INDEX).sum().clamp_min(1)
        nsp_logits = None if self.cls.seq_relationship is None else self.cls.seq_relationship(pooled_output)
        if nsp_logits is None:
            nsp_loss = mlm_loss.new_zeros(())
        else:  # ignore_index: empty slots of packed rows; every label of an unpacked batch is 0 or 1.
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label.long(), ignore_index=IGNORE_INDEX)
        return PretrainingOutput(
            loss=mlm_loss + nsp_loss,
            mlm_loss=mlm_loss,
            nsp_loss=nsp_loss,
            mlm_logits=mlm_logits,
            mlm_labels=labels,
            nsp_logits=nsp_logits,
            mlm_loss_sum=mlm_loss_sum,
        )

    def masked_lm_logits(
        self, sequence_output: torch.Tensor, masked_positions: torch.Tensor, masked_labels: torch.Tensor,
        flat_positions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the hidden states of every `masked_positions` slot, then run the MLM head on those.

        Returns ([slots, vocab] logits, [slots] labels) with slots = masked_positions.numel(): a shape
        known from the inputs' shapes alone (no host sync); empty slots keep IGNORE_INDEX labels.
        `flat_positions`: the positions index the flattened [rows*seq] tokens (packed batches), not
        each row's own tokens.
        """
        hidden = sequence_output.size(-1)
        if flat_positions:
            sequence_output = sequence_output.reshape(1, -1, hidden)
            masked_positions = masked_positions.reshape(1, -1)
        index = masked_positions.long().unsqueeze(-1).expand(-1, -1, hidden)
        gathered = torch.gather(sequence_output, 1, index)  # [batch, max_predictions, hidden]
        return self.cls.predictions(gathered.reshape(-1, hidden)), masked_labels.reshape(-1).long()

    def dense_mlm_logits(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits at every position (what `BertForPreTraining` computes); for checks and benchmarks."""
        encoded = self.bert(input_ids=input_ids, attention_mask=self.attention_mask(key_padding_mask(attention_mask)),
                            token_type_ids=token_type_ids)
        return self.cls.predictions(encoded[0])

    def attention_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padded and packed paths' bool mask, for the attention implementation the config names now (read at
        every forward: `_from_config(config, attn_implementation=...)` elsewhere can change a shared config)."""
        return mask_for_attention(mask, self.config._attn_implementation, self.dtype)


def masked_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the labelled slots (empty slots add exactly 0), in fp32."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def build_model(config: BertConfig, activation_checkpointing: bool = False) -> SparseBertForPreTraining:
    """A freshly initialised model with PyTorch SDPA attention (flash / memory-efficient kernels on GPU), with a
    config of its own: `_from_config` sets the implementation on the config it is given, which the caller shares."""
    model = SparseBertForPreTraining._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    if activation_checkpointing:
        # Recompute each encoder layer in backward: ~1/3 more compute for activations of O(layers) less.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_parameters(model: BertForPreTraining) -> dict[str, int]:
    """Parameter counts the FLOP model needs: encoder layers, MLM head (incl. tied decoder), embeddings."""
    encoder = sum(p.numel() for p in model.bert.encoder.parameters())
    pooler = sum(p.numel() for p in model.bert.pooler.parameters()) if model.bert.pooler is not None else 0
    head = sum(p.numel() for p in model.cls.predictions.transform.parameters())
    head += model.cls.predictions.decoder.weight.numel() + model.cls.predictions.decoder.bias.numel()
    embeddings = sum(p.numel() for p in model.bert.embeddings.parameters())
    total = sum(p.numel() for p in model.parameters())
    return {"encoder": encoder + pooler, "mlm_head": head, "embeddings": embeddings, "total": total}
