"""Two-phase pretraining on 2 CPU ranks through the real deepspeed launcher (ZeRO-2, ExactLamb, gloo).

Two launches cover: a full two-phase run (checkpoints of both phases, exports, TensorBoard tags),
an interrupted run (SIGTERM to one rank) resumed by the same command, a second stop inside phase 2,
and exact equality of every logged loss with the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.launching import run_ranks
from tests.support.pretrain_fixtures import PRETRAIN_SCENARIOS, build_shards, step_records, tiny_run_config

SCRIPT = PRETRAIN_SCENARIOS
TB_TAGS = [
    "loss/total", "loss/mlm", "loss/nsp", "acc/mlm", "acc/nsp", "lr", "grad_norm", "loss_scale",
    "grad_norm/embeddings", "grad_norm/layer_00", "grad_norm/layer_01", "grad_norm/head",
    "lamb/trust_ratio_min", "lamb/trust_ratio_mean", "lamb/trust_ratio_max",
    "perf/seq_per_s", "perf/tokens_per_s", "perf/tflops", "perf/mfu", "memory/max_rss_gb",
    "perf/real_tokens_per_s", "perf/instances_per_s",
    "val/mlm_loss", "val/mlm_acc",
]


def mlm_only(run_json: Path) -> None:
    """The run config trains what packed shards give, MLM alone, at the budget recipe's 30 % masking."""
    config = json.loads(run_json.read_text())
    config["data"].update(objective="mlm", mask_probability=0.3)
    run_json.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("pretrain_multirank")
    shards = build_shards(work / "shards")
    tiny_run_config(work / "run1.json", shards, work / "r1")
    tiny_run_config(work / "run2.json", shards, work / "r2")
    tiny_run_config(work / "run3.json", shards, work / "r3")
    tiny_run_config(work / "run4.json", shards, work / "r4")
    packed = build_shards(work / "shards_mlm", segments="full-sentences")  # RoBERTa's inputs: no sentence pairs
    for name in ("mlmA", "mlmB"):
        mlm_only(tiny_run_config(work / f"{name}.json", packed, work / name))
    first = run_ranks(SCRIPT, ["first", str(work)], num_ranks=2, timeout=600)
    second = run_ranks(SCRIPT, ["resume", str(work)], num_ranks=2, timeout=600)
    (work / "first.log").write_text(first.stdout + first.stderr)
    (work / "resume.log").write_text(second.stdout + second.stderr)
    return work


@pytest.mark.multirank
def test_runs_complete_with_checkpoints_of_both_phases(runs: Path) -> None:
    outcomes = json.loads((runs / "outcomes.json").read_text())
    assert outcomes == {"r1": 0, "r2_interrupted": 0, "r3_nan": 3, "r2_resumed_until_phase2": 0, "r2_finished": 0,
                        "r4_phase2_from_export": 0, "mlm_a": 0, "mlm_b_stopped": 0, "mlm_b_finished": 0}
    checkpoints = runs / "r1" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "phase2-step0000004"
    for tag in ("phase1-step0000006", "phase2-step0000004"):
        assert (checkpoints / tag / "PHASE_END").exists()
        state = json.loads((checkpoints / tag / "trainer_state.json").read_text())
        assert state["complete"] is True
        assert json.loads((checkpoints / tag / "run_config.json").read_text())["resolved"]["world_size"] == 2
    # keep_last=2: phase ends are kept, older step checkpoints pruned
    assert not (checkpoints / "phase1-step0000002").exists()
    final = json.loads((checkpoints / "phase2-step0000004" / "trainer_state.json").read_text())
    assert final["samples_seen"] == (6 + 4) * 16  # global batch 4 x 2 accumulation x 2 ranks
    assert final["data_position"] == 4 * 16  # samples of phase 2's stream consumed by all ranks


@pytest.mark.multirank
def test_a_run_naming_neither_attention_key_runs_unpadded(runs: Path) -> None:
    """model.attention defaults to auto, which is unpadded on CPU (the reference kernel, its self-test passed on the
    ranks' agreement): r1's micro-batches were the real tokens (rounded up to a bucket), so it ran fewer device rows
    than instances (its instances are seq/2 to seq long; padded rows are exactly one per instance, packing is off),
    and eager on CPU (no compile/* numbers). config.resolved.json records the choice and why."""
    resolved = json.loads((runs / "r1" / "config.resolved.json").read_text())
    assert resolved["model"]["attention"] == "auto" and resolved["model"]["compile"] is None
    chosen = resolved["resolved"]["attention"]
    assert {phase: (c["requested"], c["path"], c["compile"]) for phase, c in chosen.items()} == {
        "phase1": ("auto", "unpadded", False), "phase2": ("auto", "unpadded", False)}
    assert "the reference varlen kernel on cpu" in chosen["phase1"]["why"] and "self-test passed" in chosen["phase1"]["why"]
    records = step_records(runs / "r1").values()
    factors = [r["data/packing_factor"] for r in records]
    assert min(factors) >= 1.0 and max(factors) > 1.1, factors
    assert not any("compile/recompiles" in r for r in records)


@pytest.mark.multirank
def test_plain_runs_load_no_codistillation_module(runs: Path) -> None:
    """Codistillation is a plug-in (pretrain/plugin.py): runs without a `codistill` section never import it."""
    assert json.loads((runs / "plugin_modules.json").read_text()) == {"first": [], "resume": []}


@pytest.mark.multirank
def test_interrupted_run_resumes_to_identical_losses(runs: Path) -> None:
    reference, resumed = step_records(runs / "r1"), step_records(runs / "r2")
    assert sorted(reference) == sorted(resumed) == [("phase1", s) for s in range(1, 7)] + [
        ("phase2", s) for s in range(1, 5)
    ]
    # SIGTERM hit rank 1 only, after phase-1 step 3; the flag travels with the next step's all-reduce,
    # so both ranks stop together after step 4 and checkpoint there.
    assert "stopped (signal on another rank) at phase1 step 4" in (runs / "first.log").read_text()
    assert "stopped (run.stop_after_steps=5) at phase2 step 3" in (runs / "resume.log").read_text()
    assert (runs / "r2" / "checkpoints" / "phase1-step0000006" / "PHASE_END").exists()
    for key in reference:
        for metric in ("loss/total", "loss/mlm", "loss/nsp", "acc/mlm", "grad_norm", "lr"):
            assert resumed[key][metric] == reference[key][metric], (key, metric)
    from safetensors.torch import load_file

    ours = load_file(runs / "r2" / "export" / "phase2" / "model.safetensors")
    theirs = load_file(runs / "r1" / "export" / "phase2" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.multirank
def test_export_round_trip_matches_engine_logits(runs: Path) -> None:
    from transformers import AutoModelForPreTraining, AutoModelForQuestionAnswering, AutoTokenizer

    from pretrain.checkpointing.export import verification_batch

    export = runs / "r1" / "export" / "phase2"
    model = AutoModelForPreTraining.from_pretrained(str(export), local_files_only=True).eval()
    engine_logits = torch.load(runs / "engine_logits.pt")
    with torch.no_grad():
        logits = model(**verification_batch(model.config)).prediction_logits
    torch.testing.assert_close(logits, engine_logits, rtol=1e-5, atol=1e-5)
    qa = AutoModelForQuestionAnswering.from_pretrained(str(export), local_files_only=True)
    assert qa.bert.embeddings.word_embeddings.weight.shape[0] == model.config.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    assert tokenizer.convert_tokens_to_ids("[MASK]") == 4


@pytest.mark.multirank
def test_export_cli_reproduces_phase_end_export(runs: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from pretrain.export import main as export_main

    tag_folder = runs / "r1" / "checkpoints" / "phase1-step0000006"
    assert export_main([str(tag_folder), str(tmp_path / "out")]) == 0
    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(runs / "r1" / "export" / "phase1" / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert export_main([str(tmp_path / "missing"), str(tmp_path / "x")]) == 2


@pytest.mark.multirank
def test_tensorboard_has_every_tag(runs: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "r1" / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert set(TB_TAGS) <= scalars, sorted(set(TB_TAGS) - scalars)
    assert "lamb/trust_ratio" in events.Tags()["histograms"]
    assert len(events.Scalars("loss/total")) == 10  # once per optimizer step, both phases


@pytest.mark.multirank
def test_step_monitors_log_their_documented_tags_and_the_group_norms_add_up(runs: Path) -> None:
    """Every step row of the 2-rank run (ZeRO-2, ExactLamb, eager on CPU) holds the tags the step monitors list for
    such a run and no other of their families (tests/metrics/test_monitors.py: the same on one rank); the
    per-group gradient norms, each rank's half of every partition all-reduced, add up to DeepSpeed's grad_norm."""
    from pretrain.metrics.monitor_contract import documented_tags
    from pretrain.metrics.monitor_registry import step_monitors
    from tests.metrics.test_monitors import tag_mismatches

    docs = [doc for monitor in step_monitors(seq_len=32) for doc in documented_tags(monitor)
            if "histogram" not in doc.when]  # metrics.jsonl has the scalars (the histogram: test_tensorboard_has_every_tag)
    families = {doc.tag.split("/")[0] for doc in docs}
    records = step_records(runs / "r1")
    assert len(records) == 10
    for key, record in records.items():
        scalars = {tag for tag in record if tag.split("/")[0] in families}
        assert not tag_mismatches(docs, scalars, set(), {"cpu", "ExactLamb"}), key
        groups = [value for tag, value in record.items() if tag.startswith("grad_norm/")]
        assert len(groups) == 4 and sum(v * v for v in groups) ** 0.5 == pytest.approx(record["grad_norm"], rel=1e-5)


@pytest.mark.multirank
def test_nonfinite_loss_skips_the_step_then_aborts_with_a_checkpoint(runs: Path) -> None:
    records = step_records(runs / "r3")
    sums = json.loads((runs / "r3_weight_sums.json").read_text())
    # step 2 (index 1) had a NaN loss: not applied, weights unchanged, counted; step 3 trained again
    assert sums[1] == sums[0] and sums[2] != sums[1]
    assert records[("phase1", 2)]["failures/nonfinite_steps"] == 1.0
    assert records[("phase1", 2)]["failures/skipped_steps"] == 1.0
    assert records[("phase1", 3)]["lr"] == records[("phase1", 2)]["lr"]  # the schedule did not advance either
    # steps 4 and 5 in a row: abort after a checkpoint, with a message naming the setting
    assert sorted(records) == [("phase1", s) for s in range(1, 6)]
    state = json.loads((runs / "r3" / "checkpoints" / "phase1-step0000005" / "trainer_state.json").read_text())
    assert state["nonfinite_steps"] == 3 and state["consecutive_nonfinite"] == 2 and not state["complete"]
    assert "failures.max_consecutive_nonfinite=2" in (runs / "first.log").read_text()


@pytest.mark.multirank
def test_phase2_from_an_exported_model_continues_like_the_run(runs: Path) -> None:
    # The export holds the same fp32 weights phase 2 of R1 started from: identical phase-2 losses.
    reference, from_export = step_records(runs / "r1"), step_records(runs / "r4")
    assert sorted(from_export) == [("phase2", s) for s in range(1, 5)]
    for key in from_export:
        assert from_export[key]["loss/total"] == reference[key]["loss/total"], key


@pytest.mark.multirank
def test_packed_shards_train_mlm_alone_resume_exactly_and_export_a_masked_lm(runs: Path) -> None:
    """Shards without sentence pairs: no NSP loss or numbers, both phases resume to the same losses and weights,
    and the export is a BertForMaskedLM that transformers loads with every key accounted for."""
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, pipeline

    reference, resumed = step_records(runs / "mlmA"), step_records(runs / "mlmB")
    assert sorted(reference) == sorted(resumed) == [("phase1", s) for s in range(1, 7)] + [
        ("phase2", s) for s in range(1, 5)]
    assert "stopped (run.stop_after_steps=8) at phase2 step 2" in (runs / "resume.log").read_text()
    for key, record in reference.items():
        assert "loss/nsp" not in record and "acc/nsp" not in record
        assert record["loss/total"] == record["loss/mlm"]
        for metric in ("loss/mlm", "acc/mlm", "grad_norm", "lr"):
            assert resumed[key][metric] == record[metric], (key, metric)
    resolved = json.loads((runs / "mlmA" / "config.resolved.json").read_text())["resolved"]
    assert (resolved["objective"], resolved["segments"]) == ("mlm", "full-sentences")
    assert resolved["mask_probability"] == {"phase1": 0.3, "phase2": 0.3}
    assert resolved["max_predictions"] == {"phase1": 10, "phase2": 20}  # room for 30 % of 32 and of 64 tokens

    export = runs / "mlmA" / "export" / "phase2"
    ours, theirs = load_file(export / "model.safetensors"), load_file(runs / "mlmB" / "export" / "phase2" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    model, loading = AutoModelForMaskedLM.from_pretrained(str(export), local_files_only=True, output_loading_info=True)
    assert set(loading["missing_keys"]) == set() and set(loading["unexpected_keys"]) == set()
    assert not any(k.startswith(("bert.pooler", "cls.seq_relationship")) for k in ours)
    filled = pipeline("fill-mask", model=str(export), top_k=3)("w1 w2 [MASK] w4")
    assert len(filled) == 3 and all(0 <= g["token"] < model.config.vocab_size and 0 < g["score"] <= 1 for g in filled)
    card = (export / "README.md").read_text()
    assert "masked-LM alone" in card and "`BertForMaskedLM`" in card and "NSP {" not in card
