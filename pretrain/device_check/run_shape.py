"""The shapes a run trains at, as the device self-tests need them: heads, width, dropout and one micro-batch.

Why: a kernel or a compiled layer can be right at a test's small shapes and wrong at the run's own (a Triton
kernel picked for the real width, inductor's dropout code, a kernel path taken only past some number of segments
or heads). The kernel stage (pretrain/device_check/kernel_check.py) adds a case with the run's head count and micro-batch
of instances; the compiled-layer check (pretrain/device_check/compiled_check.py) runs one encoder layer at the run's hidden
size, heads, intermediate size and dropout. The run plan builds a RunShape from the phase's model config and
micro-batch (`run_shape`); the tests build small ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import BertConfig

SHORT_EVERY = 8  # one instance in this many is short in `micro_batch_lengths` (a document's end, BERT's short_seq_prob)


@dataclass(frozen=True)
class RunShape:
    """One encoder layer's shape and one micro-batch, as the run trains them."""

    heads: int
    hidden: int
    intermediate: int
    attention_dropout: float  # attention_probs_dropout_prob
    hidden_dropout: float  # hidden_dropout_prob
    lengths: tuple[int, ...]  # instance lengths of one micro-batch: its segments (the bucket tail adds one)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def words(self) -> str:
        """How a verdict names the shape, e.g. 'hidden 1024, 16 heads, dropout 0.1, 65 segments'."""
        return (f"hidden {self.hidden}, {self.heads} heads, dropout {self.attention_dropout:g}/{self.hidden_dropout:g}, "
                f"{len(self.lengths)} instances")


def micro_batch_lengths(seq_len: int, micro_batch: int) -> tuple[int, ...]:
    """Instance lengths of a micro-batch of `micro_batch` instances at `seq_len` as pretraining shards hold them:
    most fill the row, one in SHORT_EVERY is short (a quarter of the row and up), so the micro-batch has the run's
    segment count (micro_batch + the bucket tail: 65 at 128 x 64, 17 at 512 x 16) and short and full segments."""
    lengths = []
    for index in range(micro_batch):
        short = index % SHORT_EVERY == SHORT_EVERY - 1
        lengths.append(max(3, seq_len // 4 + (index * 37) % (seq_len // 2)) if short else seq_len - index % 3)
    return tuple(lengths)


def run_shape(model_config: BertConfig, phases: list[tuple[int, int]]) -> RunShape:
    """The RunShape the self-tests check: the model config's layer, and the micro-batch of the phase (seq_len,
    instances per micro-batch) with the most instances (the most segments: 65 at seq 128 x 64, against 17 at
    512 x 16; both phases share the model)."""
    seq_len, micro_batch = max(phases, key=lambda phase: phase[1])
    return RunShape(heads=model_config.num_attention_heads, hidden=model_config.hidden_size,
                    intermediate=model_config.intermediate_size,
                    attention_dropout=float(model_config.attention_probs_dropout_prob),
                    hidden_dropout=float(model_config.hidden_dropout_prob),
                    lengths=micro_batch_lengths(seq_len, micro_batch))
