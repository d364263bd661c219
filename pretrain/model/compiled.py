"""Regional compilation of the unpadded encoder layer, and the counters a run logs about it.

`compile_layers` compiles `unpadded_layer` (pretrain/model/unpadded.py) once with `torch.compile` and
hands it to the model: every encoder layer calls the same compiled function with its own module, and
dynamo lifts the parameters as graph inputs (`inline_inbuilt_nn_modules`, torch's default), so one graph
serves all layers and compile time does not grow with depth. The model's modules are not wrapped (no
`_orig_mod.` prefix): state dicts, checkpoints and exports are those of the eager model.

Shapes: the token count of an unpadded micro-batch varies (bucketed to multiples of 64) and the segment
count varies between training and a short last validation batch; both dimensions are marked dynamic
before the first call (pretrain/model/unpadded.py), so they do not recompile. What does: a new phase's
`max_seqlen` (a Python int), eval vs train mode, another dtype. The counters say how many.

Counters, cumulative over the process (what metrics.jsonl / TensorBoard log as compile/*):
- graph_breaks: dynamo's graph-break count over everything compiled in the process (0 expected);
- recompiles: graphs of the layer function beyond its first;
- seconds: time spent compiling (dynamo + AOT + inductor; torch 2.13 compiles the backward graph inside
  the same call), over everything compiled in the process (the fused LAMB step included, when it compiles).
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import compilation_time_metrics, counters

from pretrain.model.unpadded import LAYER_FORWARD_ATTRIBUTE, check_layers_supported, unpadded_layer

COMPILE_TIME = "_compile.compile_inner"  # dynamo's whole compile: AOT forward and backward, inductor


def compile_layers(model: torch.nn.Module) -> None:
    """Give `model` (a SparseBertForPreTraining) a compiled layer function for its unpadded forward."""
    check_layers_supported(model)  # type: ignore[arg-type]
    setattr(model, LAYER_FORWARD_ATTRIBUTE, torch.compile(unpadded_layer))


def has_compiled_layers(model: torch.nn.Module) -> bool:
    return getattr(model, LAYER_FORWARD_ATTRIBUTE, None) is not None


def layer_graphs() -> int:
    """How many graphs dynamo holds for the layer function (0 before its first call)."""
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(unpadded_layer.__code__))


def graph_breaks() -> int:
    return int(sum(counters["graph_break"].values()))


def compile_seconds() -> float:
    return float(sum(compilation_time_metrics.get(COMPILE_TIME, [])))


def compile_metrics(model: torch.nn.Module) -> dict[str, float]:
    """compile/* values for a step's metrics row; empty when `model` runs eager."""
    if not has_compiled_layers(model):
        return {}
    return {
        "compile/graph_breaks": float(graph_breaks()),
        "compile/recompiles": float(max(layer_graphs() - 1, 0)),
        "compile/seconds": compile_seconds(),
    }
