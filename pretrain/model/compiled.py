"""Regional compilation of the unpadded encoder layer, its failure modes, and the counters a run logs about it.

`compile_layers` hands the model a `CompiledLayer`: `unpadded_layer` (pretrain/model/unpadded.py) compiled
once with `torch.compile(fullgraph=True)`. Every encoder layer calls the same compiled function with its own
module, and dynamo lifts the parameters as graph inputs (`inline_inbuilt_nn_modules`, torch's default), so one
graph serves all layers and compile time does not grow with depth. The model's modules are not wrapped (no
`_orig_mod.` prefix): state dicts, checkpoints and exports are those of the eager model.

One way to fail. The layer is one full graph, so anything dynamo cannot trace in it (a graph break, which a
torch or transformers upgrade can introduce) is an error at its first call, with dynamo's reason and the line
of code, instead of a layer that silently runs in pieces. The same holds for a backend that cannot compile the
forward or the backward graph, and for compiled code that fails the first time it runs (a Triton kernel the GPU
refuses at launch): the call that compiles a graph also runs one backward through it (on a copy of the input,
gradients for the copy only), because torch compiles the backward lazily, inside loss.backward(), where no guard
is. The line quotes the root of the error's chain (an inductor failure's own first line is only
"backend='inductor' raised:"). Then:
- `strict` (model.compile=true): a ConfigError, one line, exit 2 at the first step;
- otherwise (model.compile=null): one line per process (every rank's, naming the rank and its host: a job whose
  ranks run compiled and eager runs at the eager rank's pace, so no rank may fall back unseen), once; the layer
  runs eager for the rest of the process (later phases too: never retried), `compile/fallback` is 1, and the ledger's `on_fallback` lets the
  driver record it (`amend_resolved`: config.resolved.json says compile false and why).
  The call that fell back, when it records gradients, raises LayerFellBack instead of running eager in place, and
  the encoder calls the layer again (pretrain/model/unpadded.py `encoder_layer`): under activation checkpointing
  the compiled attempt's saved tensors are already in the layer's checkpoint frame, and an eager call in that frame
  made its recomputation save fewer tensors (CheckpointError in loss.backward()). The RNG is put back first, so
  the eager call's dropout is an eager run's.
A later error in code that already ran compiled (an out-of-memory, a NaN check) is the run's own: it propagates.
Shapes: the token count of an unpadded micro-batch varies (bucketed to multiples of 64) and the segment count
varies between training and a short validation batch; both are marked `maybe_mark_dynamic` before every
call, so they do not recompile, and a specialization (code that needs one of them static) costs a recompile
per value, never a crash (`mark_dynamic` would raise ConstraintViolationError). What does recompile: a new
phase's `max_seqlen` (a Python int), eval vs train mode, another dtype. Past torch's recompile limit
(`torch._dynamo.config.recompile_limit`) a full-graph function raises instead of running eager unseen: one line,
`compile/recompile_limit` = 1, and the layer runs eager from there.

Counters, cumulative over the process when the driver hands every phase the same CompileLedger (what
metrics.jsonl / TensorBoard log as compile/*):
- recompiles: graphs compiled for the layer beyond its first, counted from dynamo's own `unique_graphs`
  counter around the layer's calls (no cap: the private cache listing stopped at the limit); phase 2's
  recompile for its max_seqlen shows as 1, not as a new phase's 0;
- graph_breaks: dynamo's graph-break count over everything compiled in the process (the layer has none by
  construction: fullgraph);
- seconds: time spent compiling (dynamo + AOT + inductor, the backward graph included), over everything compiled
  in the process (the fused LAMB step included, when it compiles);
- fallback / recompile_limit: 1 once the layer runs eager after a failed compile / after the limit.
Private torch names read here (guarded by tests/model/test_compile_failures.py, which says what changed):
`torch._dynamo.utils.counters` ("stats"/"unique_graphs", "graph_break"), `compilation_time_metrics`,
`torch._dynamo.exc.TorchDynamoException`, `Unsupported`, `FailOnRecompileLimitHit` and
`BackendCompilerFailed.inner_exception`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException, Unsupported
from torch._dynamo.utils import compilation_time_metrics, counters
from transformers.models.bert.modeling_bert import BertLayer

from pretrain.errors import ConfigError
from pretrain.model.unpadded import (
    LAYER_FORWARD_ATTRIBUTE,
    LayerFellBack,
    LayerForward,
    check_layers_supported,
    unpadded_layer,
)

COMPILE_TIME = "_compile.compile_inner"  # dynamo's whole compile: AOT forward and backward, inductor
_USER_CODE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')
GRAPH_BREAK = "does not compile as one graph"
NOT_COMPILED = "could not be compiled"
FIRST_RUN = "failed when its compiled code first ran"
BACKWARD = "could not compile or run its backward graph"


def ignore(_line: str) -> None:
    """No one to tell (a ledger nobody records)."""


@dataclass
class CompileLedger:
    """The compiled encoder layer over the whole process, shared by each phase's CompiledLayer (for the driver to
    hold, one per process, and hand to every phase's prepare_model_path; a fresh one per layer otherwise).

    Why per process: each phase builds a new model and a new CompiledLayer, but torch's code cache and recompile
    limit are per code object over the process, so phase 2's new max_seqlen is a recompile of the process's
    layer (counted here, not restarted at 0), and a fallback holds for the rest of the run: said once, never
    retried. `on_fallback`: called once with the reason, so the driver records what really runs
    (`amend_resolved`, config.resolved.json)."""

    graphs: int = 0  # graphs dynamo compiled for the layer in this process
    fallback: str | None = None  # why the layer runs eager (None: compiled)
    limit_hit: bool = False
    on_fallback: Callable[[str], None] = ignore


def amend_resolved(resolved: dict[str, Any], why: str) -> dict[str, Any]:
    """`resolved` (config.resolved.json) after a fallback: every phase that planned compiled layers runs them eager,
    `compile` false and `compile_why` saying why."""
    attention = resolved.get("resolved", {}).get("attention", {})
    amended = {name: {**entry, "compile": False, "compile_why": f"the encoder layer runs eager: {why}"}
               if entry.get("compile") else entry for name, entry in attention.items()}
    return {**resolved, "resolved": {**resolved.get("resolved", {}), "attention": amended}}


def first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of `error`'s chain, as Python's traceback walks it (__cause__, else an unsuppressed
    __context__), through dynamo's `inner_exception` (BackendCompilerFailed): the backend's own error."""
    seen = {id(error)}
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None and not error.__suppress_context__:
            inner = error.__context__
        if inner is None or id(inner) in seen:
            return error
        seen.add(id(inner))
        error = inner


def compile_failure(error: BaseException) -> str:
    """The failure in one line: the error's first non-empty line, the root cause's (the backend's real error: an
    inductor failure's own first line is only "backend='inductor' raised:"), and the last line of our code dynamo
    was tracing."""
    reason = f"{type(error).__name__}: {first_line(error)}"
    root = root_cause(error)
    if root is not error:
        reason += f"{'' if reason.endswith(':') else ';'} {type(root).__name__}: {first_line(root)}"
    places = _USER_CODE.findall(str(error).split("from user code:")[-1])
    if places:
        path, line, function, code = places[-1]
        reason += f" at {path.rsplit('/', 1)[-1]}:{line} in {function} ({code.strip()[:80]})"
    return reason


def keep(tensor: torch.Tensor) -> torch.Tensor:
    """A saved-tensor hook that keeps the tensor as it is."""
    return tensor


@dataclass(frozen=True)
class RngState:
    """The global generators' state (CPU, and the device's on CUDA) at a layer call's start, put back before a
    fallback calls the layer again eager: the eager call then draws what an eager run would, so the step's loss and
    gradients are an eager run's (a few microseconds per call: the states are small host-side copies)."""

    cpu: torch.Tensor
    device: torch.device
    cuda: torch.Tensor | None

    @classmethod
    def of(cls, device: torch.device) -> RngState:
        on_cuda = device.type == "cuda"
        return cls(torch.get_rng_state(), device, torch.cuda.get_rng_state(device) if on_cuda else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class CompiledLayer:
    """`unpadded_layer` compiled as one full graph, with its failures and recompiles made explicit (module docstring).

    `say`: how a line reaches the console (every rank says its own fallback: pretrain/model/setup.py). `backend`:
    inductor in a run; tests pass "eager", "aot_eager" or a planted failing backend, where code generation is not
    under test. `ledger`: the process's (CompileLedger); a fresh one by default. `where`: this process in the job,
    named in its lines (e.g. "rank 3 (node-b)")."""

    def __init__(self, function: LayerForward = unpadded_layer, strict: bool = False,
                 say: Callable[[str], None] = print, backend: Any = "inductor",
                 ledger: CompileLedger | None = None, where: str = "") -> None:
        self.eager = function
        self.compiled = torch.compile(function, fullgraph=True, backend=backend)
        self.strict, self.say = strict, say
        self.where = f" on {where}" if where else ""  # e.g. "rank 3 (node-b)": a fallback is per process
        self.ledger = ledger if ledger is not None else CompileLedger()
        self.ran: set[bool] = set()  # grad modes a call ran compiled in: later errors there are the run's own

    @property
    def graphs(self) -> int:
        return self.ledger.graphs

    @property
    def fallback(self) -> str | None:
        return self.ledger.fallback

    @property
    def limit_hit(self) -> bool:
        return self.ledger.limit_hit

    def __call__(self, layer: BertLayer, hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        if self.ledger.fallback is not None:
            return self.eager(layer, hidden, cu_seqlens, max_seqlen)
        torch._dynamo.maybe_mark_dynamic(hidden, 1)  # the token count: one graph for every bucket
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)  # the segment count
        before, stage = counters["stats"]["unique_graphs"], FIRST_RUN
        rng = RngState.of(hidden.device)  # a fallback's eager call draws the dropout masks the compiled one drew
        try:
            out = self.compiled(layer, hidden, cu_seqlens, max_seqlen)
            if self._first(before) and torch.is_grad_enabled() and out.requires_grad:
                stage = BACKWARD
                self._probe_backward(layer, hidden, cu_seqlens, max_seqlen)
            self.ran.add(torch.is_grad_enabled())
            return out
        except FailOnRecompileLimitHit:
            self._recompile_limit(counters["stats"]["unique_graphs"] - before)
        except Unsupported as error:  # a graph break
            self._failed(error, GRAPH_BREAK)
        except TorchDynamoException as error:  # a backend that cannot compile the graph
            self._failed(error, BACKWARD if stage == BACKWARD else NOT_COMPILED)
        except Exception as error:
            if not self._first(before) or isinstance(error, torch.OutOfMemoryError):
                raise  # code that already ran compiled, or memory: not a compile failure, the run's own error
            self._failed(error, stage)  # e.g. a Triton kernel the device refuses at launch
        finally:
            self.ledger.graphs += counters["stats"]["unique_graphs"] - before
        rng.restore()
        if torch.is_grad_enabled():  # the compiled attempt may have saved tensors into a checkpoint frame
            raise LayerFellBack(self.ledger.fallback)  # the caller (unpadded.encoder_layer) calls again: eager
        return self.eager(layer, hidden, cu_seqlens, max_seqlen)  # the compiled output (if any) is dropped

    def _first(self, before: int) -> bool:
        """This call runs code compiled for it: a graph compiled now, or this layer's first call in this grad mode (its
        graph may come from dynamo's cache, compiled for an earlier phase's layer, its backward never run)."""
        return counters["stats"]["unique_graphs"] > before or torch.is_grad_enabled() not in self.ran

    def _probe_backward(self, layer: BertLayer, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int) -> None:
        """One backward through the graph just compiled, now, inside the guard: torch compiles the backward graph
        lazily (in loss.backward(), outside any guard, when the eager attempt fails) and its code runs there first,
        so a failure of either would crash the step instead of falling back. On a copy of the input, gradients for
        it alone (nothing accumulates into the parameters), the RNG restored after; saved tensors kept plainly, so
        activation checkpointing's hooks see only the real call."""
        probe = hidden.detach().clone().requires_grad_()
        torch._dynamo.maybe_mark_dynamic(probe, 1)
        devices = [hidden.device] if hidden.is_cuda else []
        with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(keep, keep):
            out = self.compiled(layer, probe, cu_seqlens, max_seqlen)
            torch.autograd.grad(out, probe, torch.ones_like(out))

    def _failed(self, error: Exception, what: str) -> None:
        reason = compile_failure(error)
        if self.strict:
            raise ConfigError(f"model.compile=true: the encoder layer {what} ({reason}); "
                              "model.compile=null runs it eager with a warning, false never compiles it") from error
        self._fall_back(reason, f"compile: the encoder layer{self.where} {what} ({reason}); it runs eager from here "
                        "(compile/fallback=1; model.compile=false skips compiling)")

    def _recompile_limit(self, new_graphs: int) -> None:
        limit = torch._dynamo.config.recompile_limit
        self.ledger.limit_hit = True
        self._fall_back(f"recompile limit {limit}", f"compile: the encoder layer{self.where} reached torch's recompile limit "
                        f"({self.ledger.graphs + new_graphs} graphs, torch._dynamo.config.recompile_limit={limit}); "
                        'it runs eager from here (compile/recompile_limit=1; TORCH_LOGS="recompiles" names what '
                        "changed between calls)")

    def _fall_back(self, reason: str, line: str) -> None:
        """Eager from here, for the rest of the process: said once, recorded once."""
        self.ledger.fallback = reason
        self.say(line)
        self.ledger.on_fallback(reason)

    def metrics(self) -> dict[str, float]:
        return {
            "compile/graph_breaks": float(graph_breaks()),
            "compile/recompiles": float(max(self.ledger.graphs - 1, 0)),
            "compile/seconds": compile_seconds(),
            "compile/fallback": float(self.ledger.fallback is not None),
            "compile/recompile_limit": float(self.ledger.limit_hit),
        }


def compile_layers(model: torch.nn.Module, strict: bool = False, say: Callable[[str], None] = print,
                   ledger: CompileLedger | None = None, where: str = "") -> None:
    """Give `model` (a SparseBertForPreTraining) a compiled layer function for its unpadded forward; `ledger`: the
    process's (CompileLedger), so counts and a fallback carry over from earlier phases; `where`: this process in
    the job, for its lines (e.g. "rank 3 (node-b)")."""
    check_layers_supported(model)  # type: ignore[arg-type]
    setattr(model, LAYER_FORWARD_ATTRIBUTE, CompiledLayer(strict=strict, say=say, ledger=ledger, where=where))


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
