"""Step monitors (pretrain/metrics/monitor_registry.py): each lists its tags in its docstring, and those are the tags it
logs, here on one rank (a real step of the tiny run), on two in tests/pretrain/test_multirank.py; what a step
costs with them; and the docstring grammar itself. The per-group gradient norms against whole gradients at every
ZeRO stage: tests/pretrain/test_trainer.py (one rank) and tests/optim/test_lamb_zero.py (two ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.metrics.compile_counters import CompileCounters
from pretrain.metrics.grad_groups import layer_group
from pretrain.metrics.monitor_contract import StepMonitor, TagDoc, documented_tags
from pretrain.metrics.monitor_registry import step_monitors
from pretrain.model.compiled import compile_layers
from tests.pretrain.test_model_syncs import HostReads
from tests.support.trainer_fixtures import build_trainer

# when a documented tag is logged: the device, the optimizer, compiled layers, a window's end (slow_ranks.py);
# "histogram" says its kind
CONDITIONS = {"cuda", "cpu", "ExactLamb", "compiled", "histogram", "window"}


def tag_mismatches(docs: list[TagDoc], scalars: set[str], histograms: set[str], when: set[str]) -> list[str]:
    """What differs between the tags `docs` list for a run where `when` holds and the tags it logged: a tag logged
    but not listed (or listed for other runs), a tag listed for this run but not logged."""
    wrong = []
    for kind, logged in (("scalar", scalars), ("histogram", histograms)):
        listed = [d for d in docs if ("histogram" in d.when) == (kind == "histogram")]
        applies = [d for d in listed if d.when - {"histogram"} <= when]
        wrong += [f"{tag}: logged ({kind}), not listed for this run" for tag in sorted(logged)
                  if not any(d.pattern.fullmatch(tag) for d in applies)]
        wrong += [f"{d.tag}: listed ({kind}, {sorted(d.when)}), not logged" for d in applies
                  if not any(d.pattern.fullmatch(tag) for tag in logged)]
        wrong += [f"{d.tag}: listed for {sorted(d.when)} only, logged here" for d in listed if d not in applies
                  and any(d.pattern.fullmatch(tag) for tag in logged)]
    return wrong


def test_every_registered_monitor_lists_its_tags() -> None:
    monitors = step_monitors(seq_len=32)
    assert len({type(m) for m in monitors}) == len(monitors)
    tags = [doc for monitor in monitors for doc in documented_tags(monitor)]
    for monitor in monitors:
        assert documented_tags(monitor), f"{type(monitor).__name__}: no Tags: line"
    assert len({doc.tag for doc in tags}) == len(tags), "two monitors list one tag"
    assert set().union(*(doc.when for doc in tags)) <= CONDITIONS


def test_a_tags_line_reads_back_with_its_conditions_and_placeholders() -> None:
    class Probe(StepMonitor):
        """A monitor's docstring.

        Tags:
            probe/plain           always logged
            probe/layer_<NN>      [cuda, histogram] one per layer

        Not a tag: the list ends at the first blank line.
        """

    plain, per_layer = documented_tags(Probe)
    assert (plain.tag, plain.when, plain.what) == ("probe/plain", frozenset(), "always logged")
    assert per_layer.when == {"cuda", "histogram"} and per_layer.pattern.fullmatch("probe/layer_07")
    assert not per_layer.pattern.fullmatch("probe/layer_07/x") and not plain.pattern.fullmatch("probe/plainer")

    class Bad(StepMonitor):
        """Bad.

        Tags:
            probe/no_meaning
        """

    with pytest.raises(ValueError, match=r"tag \[when\] what"):
        documented_tags(Bad)
    assert [layer_group(n) for n in ("bert.embeddings.LayerNorm.weight", "bert.encoder.layer.11.output.dense.bias",
                                     "bert.pooler.dense.weight", "cls.predictions.bias")] == [
        "embeddings", "layer_11", "head", "head"]


def test_each_monitor_logs_the_tags_its_docstring_lists_and_adds_no_host_read(tmp_path: Path) -> None:
    """One rank, the tiny run (ZeRO-2, ExactLamb, eager on a CPU): what each monitor logs after a real step is
    what its docstring lists for such a run, and once the layers are compiled, the compile counters too. The
    monitors' share of a step (before_step and the step's hook) reads nothing on the host: a step with them
    and a step without read the same number of device values (`values`, a logged step's, is not in either)."""
    trainer = build_trainer(tmp_path, ["--model.compile=false"], steps=4)
    trainer.train_step()  # the first step also starts the data loader (a read of its own)
    trainer.state.step += 1
    with HostReads() as with_monitors:
        result = trainer.train_step()
    trainer.state.step += 1
    when = {trainer.dist_info.device.type, "ExactLamb"}
    for monitor in trainer.monitors:
        scalars, histograms = monitor.values(result), monitor.histograms()
        wrong = tag_mismatches(documented_tags(monitor), set(scalars), set(histograms), when)
        assert not wrong, f"{type(monitor).__name__}: {wrong}"
    counters = next(m for m in trainer.monitors if isinstance(m, CompileCounters))
    for monitor in trainer.monitors:
        monitor.close()
    trainer.monitors = []
    with HostReads() as without:
        trainer.train_step()
    assert with_monitors.count == without.count > 0
    compile_layers(trainer.engine.module)  # a compiled layer's counters (nothing compiles: no step follows)
    counters.attach(trainer.engine)
    wrong = tag_mismatches(documented_tags(counters), set(counters.values(result)), set(), when | {"compiled"})
    assert not wrong, wrong
