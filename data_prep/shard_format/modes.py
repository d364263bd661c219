"""How a shard folder's instances were made, as the manifest records it: the values the build's flags take and
the ranks read back (segment modes, masking modes), BERT's masking rate and the prediction slots it sizes.

Declared here, below the build's configuration (data_prep/config.py) and the format's reader
(data_prep/shard_format/shards.py), so that both, and the ranks, read one spelling without pulling in pyarrow.
"""

from __future__ import annotations

MASKING_MODES = ("dynamic", "static")
# How an instance's tokens are chosen (data_prep/instances.py).
NSP = "nsp"  # BERT's sentence pairs with a next-sentence label
FULL_SENTENCES = "full-sentences"  # RoBERTa: packed whole sentences, across documents, MLM only
DOC_SENTENCES = "doc-sentences"  # RoBERTa: packed whole sentences, within one document, MLM only
SEGMENT_MODES = (NSP, FULL_SENTENCES, DOC_SENTENCES)
BERT_MASK_PROB = 0.15  # the rate BERT's 20 predictions at 128 were sized for


def max_predictions_for(seq_len: int, mask_prob: float = BERT_MASK_PROB) -> int:
    """Prediction slots per instance: BERT's 20 at 128 and 80 at 512 for its 15 % rate, proportional to
    the length and to the rate (40 and 160 at 30 %), so the cap never keeps a higher rate from being
    reached. 0.15 / 0.15 is exactly 1.0, so the default gives today's numbers to the unit."""
    return max(1, round(seq_len * 20 / 128 * (mask_prob / BERT_MASK_PROB)))
