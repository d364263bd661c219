"""A compile failure found inside an activation-checkpointed layer falls back and trains on (pretrain/model/compiled.py
with pretrain/model/unpadded.py `encoder_layer`). The failures are planted in the backend, as a GPU would show them
only at the run's own shapes: the backward graph does not compile, the backward's code raises at its first run (a
Triton "out of resource"), and the same two for the forward. Each runs under non-reentrant checkpointing (as the
driver sets it), training first (and validation, no_grad, first for one backward and one forward plant), with
dropout on: one line, and the step's loss and every gradient equal to the eager model's, then a second step. Before the retry outside the checkpoint frame,
a backward failure printed its line and loss.backward() died of CheckpointError ("A different number of tensors
was saved during the original forward and recomputation")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from pretrain.data.batches import PhaseData
from pretrain.model.bert import SparseBertForPreTraining, bert_config, build_model
from pretrain.model.compiled import CompiledLayer, compile_metrics
from pretrain.model.unpadded import LAYER_FORWARD_ATTRIBUTE
from tests.support.model_fixtures import both_layouts

OUT_OF_RESOURCE = "out of resource: shared memory, Required: 232448, Hardware limit: 101376"


class OutOfResources(Exception):
    """Shaped like Triton's launch error (triton.runtime.errors.OutOfResources)."""


@pytest.fixture(autouse=True)
def fresh_code_cache() -> Any:
    """Each test leaves torch's code cache as it found it (empty): later tests count the layer's graphs from 0."""
    yield
    torch._dynamo.reset()


def planted_backend(what: str) -> Any:
    """Eager code through AOT autograd, failing as `what` says: bw / fw (that graph does not compile), bwrun / fwrun
    (that graph's code raises when it first runs)."""

    def compiler(part: str) -> Callable[[torch.fx.GraphModule, list[Any]], Any]:
        def compile_part(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Any:
            if what == part:
                raise RuntimeError(f"planted: the {part} graph does not compile")
            if what == f"{part}run":
                def run(_args: list[Any]) -> Any:
                    raise OutOfResources(OUT_OF_RESOURCE)

                run._boxed_call = True  # type: ignore[attr-defined]
                return run
            return make_boxed_func(gm.forward)

        return compile_part

    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))


def checkpointed_model(vocab_size: int) -> SparseBertForPreTraining:
    """The tiny model with BERT's dropout (so the fallback's RNG matters) and non-reentrant checkpointing."""
    torch.manual_seed(0)
    model = build_model(bert_config("tiny", vocab_size, 64))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def step(model: SparseBertForPreTraining, batch: dict[str, Any], seed: int) -> tuple[torch.Tensor, dict]:
    """(loss, every parameter's gradient) of one training forward and backward from RNG seed `seed`."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def validate(model: SparseBertForPreTraining, batch: dict[str, Any]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**batch).loss


@pytest.fixture(scope="module")
def eager_run(data: PhaseData) -> tuple[dict[str, Any], torch.Tensor, list[tuple[torch.Tensor, dict]]]:
    """(the batch, the eager model's validation loss, its two training steps)."""
    _, batch = both_layouts(data, [32, 7, 19])
    eager = checkpointed_model(data.vocab.size)
    return batch, validate(eager, batch), [step(eager, batch, seed) for seed in (1, 2)]


@pytest.mark.parametrize("what", ["bw", "bwrun", "fw", "fwrun"])
def test_a_compile_failure_inside_a_checkpointed_layer_falls_back_and_trains_as_eager(
        data: PhaseData, eager_run: tuple[dict[str, Any], torch.Tensor, list], what: str) -> None:
    batch, want_val, want = eager_run
    orders = (False, True) if what in ("bwrun", "fw") else (False,)  # both orders for a backward and a forward plant
    for validation_first in orders:
        torch._dynamo.reset()  # each order on a fresh code cache, as one run's process
        model = checkpointed_model(data.vocab.size)
        said: list[str] = []
        setattr(model, LAYER_FORWARD_ATTRIBUTE, CompiledLayer(say=said.append, backend=planted_backend(what)))
        if validation_first:
            torch.testing.assert_close(validate(model, batch), want_val, rtol=0, atol=0)
        got = [step(model, batch, seed) for seed in (1, 2)]  # loss.backward() runs: no CheckpointError
        for (got_loss, got_grads), (want_loss, want_grads) in zip(got, want, strict=True):
            torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
            torch.testing.assert_close(got_grads, want_grads, rtol=0, atol=0)
        (line,) = said
        assert line.startswith("compile: the encoder layer ") and ("planted" in line or OUT_OF_RESOURCE in line), line
        assert compile_metrics(model)["compile/fallback"] == 1.0

