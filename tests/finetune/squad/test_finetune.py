"""Fine-tuning end to end on CPU: our export's layout on 2 DeepSpeed ranks, and 1-rank references."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.finetune.squad.__main__ import main
from tests.finetune.pipeline_contract import check_question_answering
from tests.support import squad_fixtures
from tests.support.launching import REPO_ROOT, run_ranks
from tests.support.paths import SCRIPTS
from tests.support.squad_fixtures import SHORT_WINDOWS

TINY_DS = {  # engine mechanics only: lr and batch are flags (tests/scripts/squad_finetune_ranks.py)
    "optimizer": {"type": "AdamW", "params": {"weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 1},
    "steps_per_print": 1000000,
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("squad")
    squad_fixtures.build_tiny_bert(work / "export", head="pretraining", seed=1)
    squad_fixtures.build_tiny_bert(work / "qa", head="qa", seed=2)
    squad_fixtures.write_squad(work / "train.json", repeat=2)
    squad_fixtures.write_squad(work / "dev.json")
    (work / "ds.json").write_text(json.dumps(TINY_DS))
    return work


def _dev_ids(work: Path) -> set[str]:
    data = json.loads((work / "dev.json").read_text())
    return {qa["id"] for article in data["data"] for p in article["paragraphs"] for qa in p["qas"]}


@pytest.mark.multirank
def test_two_rank_finetune_and_exactly_once_evaluation(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_ranks(SCRIPTS / "squad_finetune_ranks.py", [str(work)], num_ranks=2, timeout=600)
    trained = work / "out_train"
    results = json.loads((trained / "results.json").read_text())
    assert results["world_size"] == 2 and results["train_steps"] == 6 and results["train_batch_size"] == 8
    # several ranks keep the JSON's ZeRO-1: each holds its partition of AdamW's state
    assert (results["zero_stage"], results["optimizer_wrapper"]) == (1, "DeepSpeedZeroOptimizer")
    assert set(results["scores"]) == {"exact_match", "f1"} and 0 <= results["scores"]["f1"] <= 100
    assert results["vocab_check"]["unk_share"] == 0.0  # the fixture's tokenizer reads every word
    predictions = json.loads((trained / "predictions.json").read_text())
    assert set(predictions) == _dev_ids(work)  # a prediction for every question
    assert list((trained / "tensorboard").glob("events.out.tfevents.*"))
    # The evaluate command reproduces the number the fine-tuner wrote.
    assert main(["evaluate", str(work / "dev.json"), str(trained / "predictions.json")]) == 0
    assert json.loads(capsys.readouterr().out) == results["scores"]

    # Evaluation on 2 ranks (uneven blocks, a padding batch) == the same model scored in this process.
    two = json.loads((work / "out_eval" / "results.json").read_text())
    assert two["dev_windows"] % 2 == 1, "pick window sizes that give an odd number of windows"
    nbest_one = _single_process_nbest(work)
    nbest_two = json.loads((work / "out_eval" / "nbest_predictions.json").read_text())
    predictions_two = json.loads((work / "out_eval" / "predictions.json").read_text())
    assert nbest_one.keys() == nbest_two.keys() == predictions_two.keys() == _dev_ids(work)
    for qid, entries in nbest_one.items():
        assert predictions_two[qid] == entries[0]["text"]
        assert [e["text"] for e in entries] == [e["text"] for e in nbest_two[qid]]
        assert [e["start_logit"] for e in entries] == pytest.approx([e["start_logit"] for e in nbest_two[qid]], abs=1e-5)


def _single_process_nbest(work: Path) -> dict:
    """The n-best lists of work/qa on dev.json computed here, without ranks or an engine."""
    import torch
    from transformers import AutoTokenizer, BertForQuestionAnswering

    from pretrain.finetune.squad.data import load_squad
    from pretrain.finetune.squad.features import FeatureConfig, build_features
    from pretrain.finetune.squad.inference import gather_logits
    from pretrain.finetune.squad.postprocess import PostprocessConfig, postprocess

    tokenizer = AutoTokenizer.from_pretrained(str(work / "qa"))
    model = BertForQuestionAnswering.from_pretrained(str(work / "qa")).eval()
    examples = load_squad(work / "dev.json").examples
    lengths = dict(zip(SHORT_WINDOWS[::2], map(int, SHORT_WINDOWS[1::2]), strict=True))
    config = FeatureConfig(lengths["--max-seq-length"], lengths["--doc-stride"], lengths["--max-query-length"])
    features = build_features(examples, tokenizer, config, with_labels=False)
    starts, ends = gather_logits(model, features, 64, tokenizer.pad_token_id, torch.device("cpu"))
    return postprocess(examples, features, starts, ends, PostprocessConfig()).nbest


def test_single_process_finetune_with_exact_lamb(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """lr 3e-2: LAMB moves each layer by ~lr of its norm, so at 1e-3 three steps changed the loss less than
    the next batch's draw did (it rose as often as it fell); at 3e-2 it falls well clear of that noise."""
    out = work / "out_lamb"  # in this process (the 2-rank test above runs the command line on its ranks)
    code = main(["finetune", "--model", str(work / "qa"), "--train", str(work / "train.json"),
                "--dev", str(work / "dev.json"), "--out", str(out), "--ds-config",
                str(REPO_ROOT / "ds_configs" / "deepspeed" / "squad_lamb_zero1.json"), "--max-steps", "3", "--log-every", "1",
                "--lr", "3e-2", "--save-model", *SHORT_WINDOWS])
    printed = capsys.readouterr().out
    assert code == 0, printed[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 1 and results["precision"] == "fp32"  # auto: fp32 on CPU
    assert results["train_batch_size"] == 32
    assert set(json.loads((out / "predictions.json").read_text())) == _dev_ids(work)
    assert "step 3/3" in printed
    assert (out / "model" / "config.json").is_file() and (out / "model" / "model.safetensors").is_file()
    # our LAMB really ran, stepped by the engine itself (one rank, fp32: the JSON's ZeRO-1 would partition
    # nothing), and it trained: the loss fell and every tensor moved
    assert (results["optimizer"], results["optimizer_wrapper"], results["zero_stage"]) == ("ExactLamb", "ExactLamb", 0)
    losses = [float(line.split(" loss ")[1].split()[0]) for line in printed.splitlines() if " loss " in line]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    from safetensors.torch import load_file

    before, after = load_file(work / "qa" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    moved = [name for name in before if name in after and not torch.equal(before[name], after[name])]
    assert len(moved) >= 0.9 * len(before), f"{len(moved)} of {len(before)} tensors changed"
    # The saved folder's contract (issue 40): it answers through transformers' Auto classes and pipeline.
    context, questions = squad_fixtures.PARAGRAPHS[1]
    check_question_answering(out / "model", context, questions[0][0])


def test_a_one_rank_fp32_finetune_builds_no_zero_partitioning(work: Path) -> None:
    """The shipped JSON asks for ZeRO-1; on one rank in fp32 the real engine steps torch's fused AdamW on the
    module's own parameters: no ZeRO wrapper, no flat partitions, no gradient all-reduce. Several ranks or
    low precision keep the JSON's stage."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from transformers import BertForQuestionAnswering

    from pretrain.engine import build_engine
    from pretrain.finetune.common import skip_lone_rank_allreduce
    from pretrain.finetune.squad.finetune import load_ds_config

    shipped = REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json"
    ds = load_ds_config(_config(shipped, "--batch-size", "4"), 1, "cpu", False)
    model = BertForQuestionAnswering.from_pretrained(str(work / "qa"))
    engine = build_engine(model, ds)
    skip_lone_rank_allreduce(engine, 1)
    assert engine.zero_optimization_stage() == 0 and not engine.enable_backward_allreduce
    assert engine.optimizer is engine.basic_optimizer and not isinstance(engine.optimizer, DeepSpeedZeroOptimizer)
    assert isinstance(engine.optimizer, torch.optim.AdamW) and engine.optimizer.defaults["fused"]
    stepped = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in model.parameters()}  # the module's own tensors, not flat copies
    engine.destroy()
    assert load_ds_config(_config(shipped), 2, "cpu", False)["zero_optimization"]["stage"] == 1
    assert load_ds_config(_config(shipped), 1, "cuda", True)["zero_optimization"]["stage"] == 1  # bf16


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_micro_batches_give_each_window_once_per_epoch(world_size: int) -> None:
    from pretrain.finetune.squad.finetune import micro_batches

    streams = [micro_batches(10, 3, world_size, rank, seed=7) for rank in range(world_size)]
    order: list[int] = []
    for _ in range(7):  # several epochs, with rounds that cross epoch boundaries
        rounds = [next(stream) for stream in streams]
        assert all(len(batch) == 3 for batch in rounds)
        order += [index for batch in rounds for index in batch]
    for epoch in range(len(order) // 10):
        assert sorted(order[epoch * 10 : (epoch + 1) * 10]) == list(range(10))


def _config(ds_config: Path, *flags: str) -> Any:
    import argparse

    from pretrain.finetune.squad.finetune_args import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--model", "m", "--out", "o", "--dev", "d.json",
                                               "--ds-config", str(ds_config), *flags]))


@pytest.mark.parametrize(
    ("owned", "message"),
    [
        ({"train_batch_size": 32}, "train_batch_size belongs to the command line: pass --batch-size=32"),
        ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu belongs to the command line: "
                                                "pass --micro-batch-size=4"),
        ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps belongs to the command line: "
                                             "pass --gradient-accumulation-steps=1"),
        ({"optimizer": {"params": {"lr": 3e-5}}}, "optimizer.params.lr belongs to the command line: pass --lr=3e-05"),
        ({"bf16": {"enabled": True}}, "bf16.enabled belongs to the command line: pass --precision=bf16"),
        ({"fp16": {"enabled": True}}, "fp16.enabled belongs to the command line: pass --precision=fp16"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler belongs to the command line: pass --warmup-fraction"),
    ],
)
def test_a_squad_json_that_sets_what_a_flag_owns_is_refused_naming_the_flag(tmp_path: Path, owned: dict,
                                                                           message: str) -> None:
    from pretrain.config.deepspeed import deep_merge
    from pretrain.finetune.squad.data import SquadFormatError
    from pretrain.finetune.squad.finetune import load_ds_config

    shipped = json.loads((REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json").read_text())
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps(deep_merge(shipped, owned)))
    with pytest.raises(SquadFormatError) as err:
        load_ds_config(_config(bad), 1, "cpu", False)
    assert str(err.value) == f"--ds-config {bad}: {message} and remove it here"


def test_squad_batch_lr_and_precision_come_from_the_flags() -> None:
    from pretrain.finetune.squad.data import SquadFormatError
    from pretrain.finetune.squad.finetune import load_ds_config

    shipped = REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json"
    default = load_ds_config(_config(shipped), 2, "cuda", True)  # the previous squad.json's values
    assert (default["train_batch_size"], default["train_micro_batch_size_per_gpu"],
            default["gradient_accumulation_steps"]) == (32, 16, 1)
    assert default["optimizer"]["params"]["lr"] == 3e-5 and default["bf16"]["enabled"]
    small = load_ds_config(_config(shipped, "--micro-batch-size", "4", "--lr", "1e-3"), 2, "cpu", False)
    assert (small["train_batch_size"], small["gradient_accumulation_steps"]) == (32, 4)  # accumulation derived
    assert small["optimizer"]["params"]["lr"] == 1e-3 and not (small["bf16"]["enabled"] or small["fp16"]["enabled"])
    fp16 = load_ds_config(_config(shipped, "--gradient-accumulation-steps", "2"), 4, "cuda", False)
    assert (fp16["train_micro_batch_size_per_gpu"], fp16["fp16"]["enabled"]) == (4, True)  # 32 / (2 x 4), no bf16
    with pytest.raises(SquadFormatError, match=r"^--batch-size: 30 is not divisible by --micro-batch-size 4 x "
                                               r"data-parallel size 2$"):
        load_ds_config(_config(shipped, "--batch-size", "30", "--micro-batch-size", "4"), 2, "cpu", False)
    with pytest.raises(SquadFormatError, match="--batch-size must be > 0, got 0"):
        _config(shipped, "--batch-size", "0")


def test_the_throughput_timer_is_off_unless_the_json_turns_it_on(tmp_path: Path) -> None:
    """DeepSpeed's throughput timer syncs the device twice a step for a figure the fine-tune never prints."""
    from pretrain.finetune.squad.finetune import load_ds_config

    shipped = json.loads((REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json").read_text())
    shipped.pop("timers", None)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(shipped))
    assert load_ds_config(_config(plain), 1, "cpu", False)["timers"] == {"throughput": {"enabled": False}}
    on = tmp_path / "on.json"
    on.write_text(json.dumps({**shipped, "timers": {"throughput": {"enabled": True, "synchronized": False}}}))
    assert load_ds_config(_config(on), 1, "cpu", False)["timers"] == {"throughput": {"enabled": True,
                                                                                   "synchronized": False}}
