"""``finetune``: a BERT folder → DeepSpeed fine-tuning on SQuAD → predictions and official-equal EM/F1.

Order of work: every input is validated (data files, model folder, DeepSpeed JSON) before the
process group, the model or the tokenizer is touched, so a typo fails in seconds, not after
tokenising; then the tokenizer is checked against the model and the text (``vocab_check``: refused
when the text reads as [UNK]s) before the model loads. Training is a plain loop over an engine from
``pretrain.engine.build_engine`` (AdamW or our ExactLamb and ZeRO from the JSON; lr, batch and precision
from the flags: auto = fp32 on CPU, bf16 or fp16 on GPU), with linear warmup and linear decay. Evaluation
scores every dev window once across all ranks (``inference.gather_logits``); rank 0 post-processes, writes
the files and scores them with ``metric``.

Outputs in ``--out``: predictions.json, nbest_predictions.json, null_odds.json (v2 only),
results.json (with ``vocab_check``: the share of [UNK] in the text the fine-tune read), tensorboard/ (scalars
``train/loss``, ``train/lr``, ``squad/*``) and, with ``--save-model``, model/ (save_pretrained + tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.config.deepspeed import precision_of
from pretrain.errors import ConfigError
from pretrain.finetune.common import (  # noqa: F401 (FINETUNE_OWNERS re-exported)
    FINETUNE_OWNERS,
    check_model_dir,
    engine_ds_config,
    micro_batches,
    skip_lone_rank_allreduce,
)
from pretrain.finetune.common import read_engine_json as common_read_engine_json
from pretrain.finetune.layout import MODEL, NBEST_PREDICTIONS, NULL_ODDS, PREDICTIONS, RESULTS, TENSORBOARD
from pretrain.finetune.squad.data import SquadFormatError, SquadSet, load_hf_squad, load_squad
from pretrain.finetune.squad.features import FeatureConfig, Features, build_features, pad_batch
from pretrain.finetune.squad.finetune_args import FinetuneConfig
from pretrain.finetune.squad.inference import gather_logits
from pretrain.finetune.squad.metric import evaluate_v1, evaluate_v2
from pretrain.finetune.squad.postprocess import PostprocessConfig, postprocess
from pretrain.finetune.vocab_check import VocabCheck, check_vocab
from pretrain.schedules.lr import WarmupPolyDecay

# Where the settings a SQuAD DeepSpeed JSON must not set live: the finetune flags (pretrain/finetune/common.py).
SQUAD_OWNERS = FINETUNE_OWNERS


def read_engine_json(config: FinetuneConfig) -> dict[str, Any]:
    """--ds-config read and refused when it sets what a flag owns (no process group needed: checked early)."""
    try:
        return common_read_engine_json(config.ds_config)
    except ConfigError as err:
        raise SquadFormatError(str(err)) from None


def load_ds_config(config: FinetuneConfig, world_size: int, device_type: str, bf16_supported: bool) -> dict[str, Any]:
    """The engine's dict: the JSON's mechanics + the flags' lr, batch for `world_size` ranks and precision."""
    try:
        return engine_ds_config(config, world_size, device_type, bf16_supported)
    except ConfigError as err:
        raise SquadFormatError(str(err)) from None


def load_data(config: FinetuneConfig) -> tuple[SquadSet | None, SquadSet]:
    if config.hf_dataset is not None:
        return load_hf_squad(config.hf_dataset, "train"), load_hf_squad(config.hf_dataset, "validation")
    assert config.dev is not None
    train = load_squad(config.train) if config.train is not None else None
    return train, load_squad(config.dev, check_offsets=False)


def as_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(value).to(device) for key, value in batch.items()}


@dataclass(frozen=True)
class TrainData:
    """What the training loop reads: the windows, how many per rank per micro-batch, and their order."""

    features: Features
    micro_batch_size: int
    accumulation: int  # micro-batches per rank per optimizer step
    pad_id: int
    seed: int  # of the window order (micro_batches)

    @classmethod
    def of(cls, features: Features, ds: dict[str, Any], pad_id: int, seed: int) -> TrainData:
        return cls(features, ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], pad_id, seed)


def training_steps(engine: Any, data: TrainData, dist_info: Any) -> Iterator[torch.Tensor]:
    """One optimizer step per ``next()``: yields the step's mean loss as a tensor, forever.

    A generator rather than a loop so that a benchmark can interleave it step by step with another
    loop in one process (bench/squad_vs_plain.py); ``train`` drives it. The loss stays a tensor:
    reading it (a host sync on a GPU) is left to the caller, once per log line.
    """
    batches = micro_batches(len(data.features), data.micro_batch_size, dist_info.world_size, dist_info.rank,
                            data.seed)
    while True:
        step_loss = torch.zeros((), device=dist_info.device)
        for _ in range(data.accumulation):
            inputs = as_tensors(pad_batch(data.features, next(batches), data.pad_id), dist_info.device)
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / data.accumulation
        yield step_loss


def train(engine: Any, data: TrainData, total_steps: int, config: FinetuneConfig, dist_info: Any,
          writer: Any) -> dict[str, float]:
    engine.train()
    steps = training_steps(engine, data, dist_info)
    started = time.perf_counter()
    loss_sum = torch.zeros((), device=dist_info.device)
    logged_steps = 0
    for step in range(total_steps):
        loss_sum += next(steps)
        logged_steps += 1
        if (step + 1) % config.log_every == 0 or step + 1 == total_steps:
            # One small all-reduce per log line: the logged loss is the global batch's, not rank 0's.
            if dist_info.world_size > 1:
                dist.all_reduce(loss_sum)
            mean_loss = loss_sum.item() / dist_info.world_size / logged_steps
            loss_sum.zero_()
            logged_steps = 0
            lr = engine.get_lr()[0]
            if dist_info.rank == 0:
                writer.add_scalar("train/loss", mean_loss, step + 1)
                writer.add_scalar("train/lr", lr, step + 1)
                print(f"step {step + 1}/{total_steps} loss {mean_loss:.4f} lr {lr:.3g}", flush=True)
    return {"train_steps": total_steps, "train_seconds": time.perf_counter() - started}


def score(dev: SquadSet, answers: dict[str, str], null_odds: dict[str, float], version: int) -> dict[str, Any]:
    if version == 1:
        return evaluate_v1(dev.articles, answers).scores
    return evaluate_v2(dev.articles, answers, null_odds).scores


def load_and_limit(config: FinetuneConfig) -> tuple[SquadSet | None, SquadSet, int]:
    """Both sets, validated, cut to --max-*-examples (the dev articles too, so the score covers them only)."""
    train_set, dev_set = load_data(config)
    version = config.version or max(dev_set.version, train_set.version if train_set else 1)
    unanswerable = next((e.qid for e in dev_set.examples if e.is_impossible), None)
    if version == 1 and unanswerable is not None:
        raise SquadFormatError(
            f"{dev_set.source}: question id {unanswerable!r} is unanswerable (SQuAD v2.0): use --version 2"
        )
    if config.max_train_examples and train_set is not None:
        train_set = dataclasses.replace(train_set, examples=train_set.examples[: config.max_train_examples])
    if config.max_eval_examples:
        dev_examples = dev_set.examples[: config.max_eval_examples]
        keep = {e.qid for e in dev_examples}
        articles = [
            {**a, "paragraphs": [{**p, "qas": [q for q in p["qas"] if q["id"] in keep]} for p in a["paragraphs"]]}
            for a in dev_set.articles
        ]
        dev_set = dataclasses.replace(dev_set, articles=articles, examples=dev_examples)
    return train_set, dev_set, version


def squad_texts(*sets: SquadSet | None) -> Iterator[str]:
    """The raw text a fine-tune tokenizes: every context and question (vocab_check samples them)."""
    for squad_set in sets:
        for example in squad_set.examples if squad_set is not None else ():
            yield example.context
            yield example.question


def finetune(config: FinetuneConfig) -> dict[str, Any] | None:
    """Run the whole job; returns results (rank 0) or None (other ranks)."""
    model_config = check_model_dir(config.model)
    if config.max_seq_length > model_config.get("max_position_embeddings", 512):
        raise SquadFormatError(
            f"--max-seq-length {config.max_seq_length} exceeds max_position_embeddings "
            f"{model_config.get('max_position_embeddings')} in {config.model / 'config.json'}"
        )
    if not config.ds_config.is_file():
        raise SquadFormatError(f"--ds-config {config.ds_config}: no such file")
    read_engine_json(config)
    train_set, dev_set, version = load_and_limit(config)

    # Heavy imports only now that the inputs are known to be good.
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering

    from pretrain.distributed.process_group import init_distributed
    from pretrain.engine import build_engine

    dist_info = init_distributed()
    bf16_supported = dist_info.device.type == "cuda" and torch.cuda.is_bf16_supported()
    ds = load_ds_config(config, dist_info.world_size, dist_info.device.type, bf16_supported)
    if config.save_model and ds.get("zero_optimization", {}).get("stage", 0) == 3:
        raise SquadFormatError(f"--save-model: not supported with ZeRO-3 ({config.ds_config}); use stage 0-2")
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    if not tokenizer.is_fast:
        raise SquadFormatError(f"--model {config.model}: the tokenizer is not a fast tokenizer (offsets needed)")
    # The model's own tokenizer, reading this text as words (not [UNK]s), checked before the model loads.
    vocab = check_vocab(VocabCheck(tokenizer, config.model, model_config, squad_texts(train_set, dev_set),
                                   config.allow_unk, SquadFormatError, speak=dist_info.rank == 0))
    if config.random_init:  # same architecture, BERT's own initialisation (normal, std initializer_range)
        model = BertForQuestionAnswering(BertConfig.from_pretrained(str(config.model)))
    else:
        model = BertForQuestionAnswering.from_pretrained(str(config.model))
    feature_config = FeatureConfig(config.max_seq_length, config.doc_stride, config.max_query_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dev_examples = dev_set.examples

    writer = _summary_writer(config.out / TENSORBOARD) if dist_info.rank == 0 else None
    results: dict[str, Any] = {"model": str(config.model), "world_size": dist_info.world_size,
                               "precision": precision_of(ds),
                               "init": "random" if config.random_init else "model", "vocab_check": vocab.as_json()}
    if train_set is not None:
        train_features = build_features(train_set.examples, tokenizer, feature_config, with_labels=True)
        global_batch = ds["train_batch_size"]
        total_steps = config.max_steps or max(1, math.ceil(config.epochs * len(train_features) / global_batch))
        schedule = WarmupPolyDecay(total_steps, config.warmup_fraction, decay_power=1.0)
        engine = build_engine(model, ds, lr_schedule=schedule)
        skip_lone_rank_allreduce(engine, dist_info.world_size)
        results.update(train_windows=len(train_features), train_examples=len(train_set.examples),
                       train_batch_size=global_batch, optimizer=type(engine.basic_optimizer).__name__,
                       optimizer_wrapper=type(engine.optimizer).__name__,  # which DeepSpeed path really ran
                       zero_stage=int(engine.zero_optimization_stage()))
        data = TrainData.of(train_features, ds, pad_id, config.seed)
        results.update(train(engine, data, total_steps, config, dist_info, writer))
        forward, module = engine, engine.module
        engine.eval()
    else:
        module = model.to(dist_info.device)
        precision = precision_of(ds)
        if precision != "fp32":
            module = module.to(torch.bfloat16 if precision == "bf16" else torch.float16)
        module.eval()
        forward = module

    started = time.perf_counter()
    dev_features = build_features(dev_examples, tokenizer, feature_config, with_labels=False)
    gathered = gather_logits(forward, dev_features, config.eval_batch_size, pad_id, dist_info.device)
    results["eval_seconds"] = time.perf_counter() - started
    if config.save_model:
        _save_model(module, tokenizer, config.out / MODEL, dist_info.rank)
    if gathered is None:
        return None

    post = PostprocessConfig(config.n_best, config.max_answer_length, version == 2, config.null_score_diff_threshold)
    predictions = postprocess(dev_examples, dev_features, gathered[0], gathered[1], post)
    atomic_write_json(config.out / PREDICTIONS, predictions.answers)
    atomic_write_json(config.out / NBEST_PREDICTIONS, predictions.nbest)
    if version == 2:
        atomic_write_json(config.out / NULL_ODDS, predictions.null_odds)
    scores = score(dev_set, predictions.answers, predictions.null_odds, version)
    results.update(scores=scores, version=version, dev=dev_set.source, dev_examples=len(dev_examples),
                   dev_windows=len(dev_features))
    atomic_write_json(config.out / RESULTS, results)
    for key, value in scores.items():
        if isinstance(value, float):
            writer.add_scalar(f"squad/{key}", value, results.get("train_steps", 0))
    writer.close()
    print(json.dumps(scores), flush=True)
    return results


def _summary_writer(path: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(path))


def _save_model(module: torch.nn.Module, tokenizer: Any, path: Path, rank: int) -> None:
    # ZeRO-1/2 keep full weights in every rank's module, so rank 0 can save them as they are.
    if rank == 0:
        module.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
