"""Host reads of device tensors in the model's forward and backward, counted on a CPU.

Every read of a tensor's value on the host (`bool(t)`, `t.item()`, `if t.all():`) dispatches
`aten._local_scalar_dense`; on a GPU each one waits for the device queue to drain. A dispatch mode counts
them here for unpadded, padded and packed batches as the trainer hands them over (`model_inputs`), and a
spy on SDPA shows which mask reaches the kernel: none when no row is padded, so a GPU can take flash.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers.integrations.sdpa_attention as sdpa_attention
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.data.batches import Collator, RankBatches, open_phase_data
from pretrain.data.loader import model_inputs
from pretrain.model.bert import bert_config, build_model
from tests.support.pretrain_fixtures import build_shards


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def collated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Host batches of the tiny shards at seq 64: padded (instances are 32-64 tokens), one with every row
    cut to full length (no padding), and the same instances packed."""
    shards = build_shards(tmp_path_factory.mktemp("syncs") / "data", seq_lens=(64,), train=16, val=4)
    data = open_phase_data(shards, 64, None, "data.shards")
    rows = [RankBatches(data, "train", 1, 0, 1, 8).reader[i] for i in range(8)]
    full = [dict(row, input_ids=np.resize(row["input_ids"], 64)) for row in rows]
    return {
        "padded": Collator(data)(rows, np.random.default_rng(0)),
        "unpadded": Collator(data)(full, np.random.default_rng(0)),
        "packed": Collator(data, packing=True)(rows, np.random.default_rng(0)),
    }


@pytest.mark.parametrize("kind", ["unpadded", "padded", "packed"])
def test_forward_and_backward_read_nothing_on_the_host(collated: dict, kind: str) -> None:
    torch.manual_seed(0)
    model = build_model(bert_config("tiny", vocab_size=48, max_position_embeddings=64))
    batch = model_inputs(collated[kind], torch.device("cpu"))
    with HostReads() as reads:
        model(**batch).loss.backward()
    assert reads.count == 0, f"{reads.count} host reads in a {kind} forward + backward"


def test_no_mask_reaches_sdpa_without_padding_and_padded_outputs_are_unchanged(
    collated: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[torch.Tensor | None] = []
    original = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(attn_mask)
        return original(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(sdpa_attention.torch.nn.functional, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = build_model(bert_config("tiny", vocab_size=48, max_position_embeddings=64,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    model(**model_inputs(collated["unpadded"], torch.device("cpu")))
    assert seen and all(mask is None for mask in seen)
    seen.clear()
    padded = collated["padded"]
    ours = model(**model_inputs(padded, torch.device("cpu")))
    assert seen and all(mask is not None and mask.dtype == torch.bool for mask in seen)
    # transformers' own handling of the 2D mask gives the same encoder output
    reference = model.bert(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                           token_type_ids=padded["token_type_ids"])[0]
    mine = model.bert(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"].bool()[:, None, None, :],
                      token_type_ids=padded["token_type_ids"])[0]
    real = padded["attention_mask"].bool()
    torch.testing.assert_close(mine[real], reference[real], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(ours.loss)


def test_packed_and_plain_batches_keep_their_shapes(collated: dict) -> None:
    """model_inputs changes where tensors live and drops an all-ones mask, nothing else."""
    for kind, host in collated.items():
        moved = model_inputs(host, torch.device("cpu"))
        assert moved.keys() == host.keys(), kind
        for key, value in host.items():
            if moved[key] is None:
                assert key == "attention_mask" and bool(value.all()), kind
            else:
                assert torch.equal(moved[key], value), (kind, key)
    assert model_inputs(collated["unpadded"], torch.device("cpu"))["attention_mask"] is None
