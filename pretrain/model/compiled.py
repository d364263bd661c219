"""Regional compilation of the unpadded encoder layer, its failure modes, and the counters a run logs about it.

`compile_layers` hands the model a `CompiledLayer`: `unpadded_layer` (pretrain/model/unpadded.py) compiled
once with `torch.compile(fullgraph=True)`. Every encoder layer calls the same compiled function with its own
module, and dynamo lifts the parameters as graph inputs (`inline_inbuilt_nn_modules`, torch's default), so one
graph serves all layers and compile time does not grow with depth. The model's modules are not wrapped (no
`_orig_mod.` prefix): state dicts, checkpoints and exports are those of the eager model.

One way to fail. The layer is one full graph, so anything dynamo cannot trace in it (a graph break, which a
torch or transformers upgrade can introduce) is an error at its first call, with dynamo's reason and the line
of code, instead of a layer that silently runs in pieces. Then:
- `strict` (model.compile=true): a ConfigError, one line, exit 2 at the first step;
- otherwise (model.compile=null): one line (rank 0), the layer runs eager for the rest of the process, and
  `compile/fallback` is 1.
Shapes: the token count of an unpadded micro-batch varies (bucketed to multiples of 64) and the segment count
varies between training and a short validation batch; both are marked `maybe_mark_dynamic` before every
call, so they do not recompile, and a specialization (code that needs one of them static) costs a recompile
per value, never a crash (`mark_dynamic` would raise ConstraintViolationError). What does recompile: a new
phase's `max_seqlen` (a Python int), eval vs train mode, another dtype. Past torch's recompile limit
(`torch._dynamo.config.recompile_limit`) a full-graph function raises instead of running eager unseen: one line,
`compile/recompile_limit` = 1, and the layer runs eager from there.

Counters, cumulative over the process (what metrics.jsonl / TensorBoard log as compile/*):
- recompiles: graphs compiled for the layer beyond its first, counted from dynamo's own `unique_graphs`
  counter around the layer's calls (no cap: the private cache listing stopped at the limit);
- graph_breaks: dynamo's graph-break count over everything compiled in the process (the layer has none by
  construction: fullgraph);
- seconds: time spent compiling (dynamo + AOT + inductor; torch 2.13 compiles the backward graph inside
  the same call), over everything compiled in the process (the fused LAMB step included, when it compiles);
- fallback / recompile_limit: 1 once the layer runs eager after a failed compile / after the limit.
Private torch names read here (guarded by tests/model/test_compile_failures.py, which says what changed):
`torch._dynamo.utils.counters` ("stats"/"unique_graphs", "graph_break"), `compilation_time_metrics`,
`torch._dynamo.exc.TorchDynamoException` and `FailOnRecompileLimitHit`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
from torch._dynamo.utils import compilation_time_metrics, counters
from transformers.models.bert.modeling_bert import BertLayer

from pretrain.errors import ConfigError
from pretrain.model.unpadded import (
    LAYER_FORWARD_ATTRIBUTE,
    LayerForward,
    check_layers_supported,
    unpadded_layer,
)

COMPILE_TIME = "_compile.compile_inner"  # dynamo's whole compile: AOT forward and backward, inductor
_USER_CODE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def compile_failure(error: BaseException) -> str:
    """Dynamo's reason in one line: its first line, and the last line of our code it was tracing."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}"
    places = _USER_CODE.findall(text.split("from user code:")[-1])
    if places:
        path, line, function, code = places[-1]
        reason += f" at {path.rsplit('/', 1)[-1]}:{line} in {function} ({code.strip()[:80]})"
    return reason


class CompiledLayer:
    """`unpadded_layer` compiled as one full graph, with its failures and recompiles made explicit (module docstring).

    `say`: how a line reaches the console (rank 0 prints; other ranks pass a no-op). `backend`: inductor in a run;
    tests pass "eager" or "aot_eager" where the property under test does not need code generation."""

    def __init__(self, function: LayerForward = unpadded_layer, strict: bool = False,
                 say: Callable[[str], None] = print, backend: str = "inductor") -> None:
        self.eager = function
        self.compiled = torch.compile(function, fullgraph=True, backend=backend)
        self.strict, self.say = strict, say
        self.graphs = 0  # graphs dynamo compiled for this layer function
        self.fallback: str | None = None  # why the layer runs eager (None: compiled)
        self.limit_hit = False

    def __call__(self, layer: BertLayer, hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        if self.fallback is not None:
            return self.eager(layer, hidden, cu_seqlens, max_seqlen)
        torch._dynamo.maybe_mark_dynamic(hidden, 1)  # the token count: one graph for every bucket
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)  # the segment count
        before = counters["stats"]["unique_graphs"]
        try:
            return self.compiled(layer, hidden, cu_seqlens, max_seqlen)
        except FailOnRecompileLimitHit:
            self._recompile_limit()
        except TorchDynamoException as error:  # a graph break, or a backend that cannot compile the graph
            self._failed(error)
        finally:
            self.graphs += counters["stats"]["unique_graphs"] - before
        return self.eager(layer, hidden, cu_seqlens, max_seqlen)  # dynamo raised before running anything

    def _failed(self, error: TorchDynamoException) -> None:
        reason = compile_failure(error)
        if self.strict:
            raise ConfigError(f"model.compile=true: the encoder layer does not compile as one graph ({reason}); "
                              "model.compile=null runs it eager with a warning, false never compiles it") from error
        self.fallback = reason
        self.say(f"compile: the encoder layer does not compile as one graph ({reason}); it runs eager from here "
                 "(compile/fallback=1; model.compile=false skips compiling)")

    def _recompile_limit(self) -> None:
        limit = torch._dynamo.config.recompile_limit
        self.limit_hit = True
        self.fallback = f"recompile limit {limit}"
        self.say(f"compile: the encoder layer reached torch's recompile limit ({self.graphs} graphs, "
                 f"torch._dynamo.config.recompile_limit={limit}); it runs eager from here (compile/recompile_limit=1; "
                 'TORCH_LOGS="recompiles" names what changed between calls)')

    def metrics(self) -> dict[str, float]:
        return {
            "compile/graph_breaks": float(graph_breaks()),
            "compile/recompiles": float(max(self.graphs - 1, 0)),
            "compile/seconds": compile_seconds(),
            "compile/fallback": float(self.fallback is not None),
            "compile/recompile_limit": float(self.limit_hit),
        }


def compile_layers(model: torch.nn.Module, strict: bool = False, say: Callable[[str], None] = print) -> None:
    """Give `model` (a SparseBertForPreTraining) a compiled layer function for its unpadded forward."""
    check_layers_supported(model)  # type: ignore[arg-type]
    setattr(model, LAYER_FORWARD_ATTRIBUTE, CompiledLayer(strict=strict, say=say))


def compiled_layer(model: torch.nn.Module) -> CompiledLayer | None:
    forward = getattr(model, LAYER_FORWARD_ATTRIBUTE, None)
    return forward if isinstance(forward, CompiledLayer) else None


def has_compiled_layers(model: torch.nn.Module) -> bool:
    return compiled_layer(model) is not None


def graph_breaks() -> int:
    return int(sum(counters["graph_break"].values()))


def compile_seconds() -> float:
    return float(sum(compilation_time_metrics.get(COMPILE_TIME, [])))


def compile_metrics(model: torch.nn.Module) -> dict[str, float]:
    """compile/* values for a step's metrics row; empty when `model` runs eager (never compiled)."""
    layer = compiled_layer(model)
    return {} if layer is None else layer.metrics()
