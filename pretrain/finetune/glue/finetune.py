"""``finetune``: a BERT folder → DeepSpeed fine-tuning on one GLUE task, N seeds → GLUE metrics and submission files.

Order of work, as in SQuAD (pretrain/finetune/squad/finetune.py): every input is validated first (the task's
data files, the model folder, the DeepSpeed JSON), before the process group, the model or the
tokenizer is touched, so a wrong file fails in seconds. The tokenizer is checked against the model and
the text (``vocab_check``: refused when the text reads as [UNK]s). Then the sets are tokenised once, and each
seed builds a fresh ``BertForSequenceClassification`` from --model (a regression head, num_labels=1,
for STS-B) and an engine from ``pretrain.engine.build_engine`` (optimizer and ZeRO from the JSON; lr,
batch and precision from the flags), trains with linear warmup and decay, and predicts every dev and
test example once across all ranks; rank 0 scores and writes.

Outputs in ``--out``: ``results.json`` (every seed's scores, their median, the best seed, ``vocab_check``: the
share of [UNK] in the text the fine-tune read),
``seed-N/dev/TASK.tsv`` and ``seed-N/test/TASK.tsv`` (GLUE submission format; MNLI: MNLI-m.tsv and
MNLI-mm.tsv), ``submission/`` (the test files of the seed best on dev, as BERT's paper picked its
test-server runs), ``tensorboard/seed-N/`` (``train/loss``, ``train/lr``, ``glue/SET/METRIC``) and, with
``--save-model``, ``model/`` (the seed best on dev, save_pretrained + tokenizer).
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
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
from pretrain.distributed.json_collectives import all_gather_json
from pretrain.errors import ConfigError, FinetuneFormatError
from pretrain.finetune.common import (
    check_model_dir,
    engine_ds_config,
    micro_batches,
    read_engine_json,
    skip_lone_rank_allreduce,
)
from pretrain.finetune.glue.data import GlueFormatError, GlueSet, TaskData, load_task_data
from pretrain.finetune.glue.finetune_args import GlueConfig
from pretrain.finetune.glue.metric import score
from pretrain.finetune.glue.submission import write_predictions
from pretrain.finetune.glue.tasks import Task
from pretrain.finetune.layout import MODEL, RESULTS, SUBMISSION, seed_dir, seed_tensorboard
from pretrain.finetune.vocab_check import VocabCheck, check_vocab
from pretrain.schedules.lr import WarmupPolyDecay


@dataclass(frozen=True)
class Encoded:
    """One set, tokenised: token ids and segment ids per example, and the labels (None: unlabelled)."""

    indices: list[str]
    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    labels: list[int | float] | None
    max_length: int  # --max-seq-length: no batch is padded beyond it

    def __len__(self) -> int:
        return len(self.input_ids)


def encode(tokenizer: Any, glue_set: GlueSet, max_length: int) -> Encoded:
    """``[CLS] a [SEP] b [SEP]`` cut to `max_length` tokens, the longer sentence first (BERT's rule)."""
    texts_a = [e.text_a for e in glue_set.examples]
    texts_b = [e.text_b or "" for e in glue_set.examples] if glue_set.examples[0].text_b is not None else None
    tokens = tokenizer(texts_a, texts_b, truncation="longest_first", max_length=max_length, return_token_type_ids=True)
    labels = [e.label for e in glue_set.examples] if glue_set.labelled else None
    return Encoded([e.index for e in glue_set.examples], tokens["input_ids"], tokens["token_type_ids"],
                   labels, max_length)  # type: ignore[arg-type]  # labelled: no None


def pad_batch(encoded: Encoded, chosen: list[int], pad_id: int, task: Task, device: torch.device,
              with_labels: bool) -> dict[str, torch.Tensor]:
    """The chosen examples padded to the longest of them, rounded up to 8 (at most --max-seq-length)."""
    longest = max(len(encoded.input_ids[i]) for i in chosen)
    width = min(-(-longest // 8) * 8, max(longest, encoded.max_length))
    ids = np.full((len(chosen), width), pad_id, dtype=np.int64)
    types = np.zeros((len(chosen), width), dtype=np.int64)
    mask = np.zeros((len(chosen), width), dtype=np.int64)
    for row, item in enumerate(chosen):
        n = len(encoded.input_ids[item])
        ids[row, :n], types[row, :n], mask[row, :n] = encoded.input_ids[item], encoded.token_type_ids[item], 1
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    tensors = {key: torch.from_numpy(value).to(device) for key, value in batch.items()}
    if with_labels:
        assert encoded.labels is not None
        dtype = torch.float32 if task.is_regression else torch.long
        tensors["labels"] = torch.tensor([encoded.labels[i] for i in chosen], dtype=dtype, device=device)
    return tensors


@dataclass(frozen=True)
class Job:
    """What every seed shares: the flags, the task, the tokenised sets, the engine dict, the ranks."""

    config: GlueConfig
    task: Task
    train: Encoded
    dev: dict[str, Encoded]
    test: dict[str, Encoded]
    ds: dict[str, Any]
    total_steps: int
    pad_id: int
    dist_info: Any


def train(engine: Any, job: Job, seed: int, writer: Any) -> dict[str, float]:
    """`job.total_steps` optimizer steps; the loss is read (a host sync) once per log line only."""
    engine.train()
    micro, accumulation = job.ds["train_micro_batch_size_per_gpu"], job.ds["gradient_accumulation_steps"]
    info = job.dist_info
    batches = micro_batches(len(job.train), micro, info.world_size, info.rank, seed)
    started = time.perf_counter()
    loss_sum = torch.zeros((), device=info.device)
    logged = 0
    for step in range(job.total_steps):
        for _ in range(accumulation):
            inputs = pad_batch(job.train, next(batches), job.pad_id, job.task, info.device, with_labels=True)
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float() / accumulation
        logged += 1
        if (step + 1) % job.config.log_every == 0 or step + 1 == job.total_steps:
            if info.world_size > 1:
                dist.all_reduce(loss_sum)  # the global batch's loss, not rank 0's
            mean_loss = loss_sum.item() / info.world_size / logged
            loss_sum.zero_()
            logged = 0
            if info.rank == 0:
                lr = engine.get_lr()[0]
                writer.add_scalar("train/loss", mean_loss, step + 1)
                writer.add_scalar("train/lr", lr, step + 1)
                print(f"seed {seed} step {step + 1}/{job.total_steps} loss {mean_loss:.4f} lr {lr:.3g}", flush=True)
    return {"train_seconds": time.perf_counter() - started}


@torch.no_grad()
def predict(forward: Any, encoded: Encoded, job: Job) -> list[float] | None:
    """Every example's prediction (label id or score) in file order on rank 0, None on the others.

    Each rank takes one contiguous block; all run the same number of forward passes (a short rank
    repeats example 0 and drops it) so that ZeRO-3's collective parameter gathers stay in step.
    """
    info, batch_size = job.dist_info, job.config.eval_batch_size
    block = np.array_split(np.arange(len(encoded)), info.world_size)[info.rank]
    rounds = math.ceil(math.ceil(len(encoded) / info.world_size) / batch_size)
    rows: list[tuple[int, float]] = []
    for r in range(rounds):
        chosen = block[r * batch_size : (r + 1) * batch_size].tolist()
        real = len(chosen)
        inputs = pad_batch(encoded, chosen or [0], job.pad_id, job.task, info.device, with_labels=False)
        logits = forward(**inputs).logits.float()
        values = logits[:, 0] if job.task.is_regression else logits.argmax(dim=-1).float()
        rows += list(zip(chosen, values.cpu().tolist()[:real], strict=True))
    if info.world_size > 1:
        gathered = all_gather_json(rows)  # [index, value] lists, as JSON: a peer's bytes are never unpickled
        if info.rank != 0:
            return None
        rows = [row for part in gathered for row in part]
    if sorted(index for index, _ in rows) != list(range(len(encoded))):
        raise RuntimeError(f"prediction gathered {len(rows)} rows for {len(encoded)} examples")
    rows.sort()
    return [value for _, value in rows]


def load_model(job: Job) -> torch.nn.Module:
    from transformers import BertForSequenceClassification

    task = job.task
    labels = {i: name for i, name in enumerate(task.labels)} or {0: "score"}
    return BertForSequenceClassification.from_pretrained(
        str(job.config.model), num_labels=task.num_labels, id2label=labels,
        label2id={name: i for i, name in labels.items()},
        problem_type="regression" if task.is_regression else "single_label_classification")


def run_seed(job: Job, seed: int) -> dict[str, Any] | None:
    """Fine-tune one seed from --model, predict its dev and test sets; its scores on rank 0."""
    from pretrain.engine import build_engine  # DeepSpeed: only once the inputs are known to be good (run)

    torch.manual_seed(seed)
    writer = summary_writer(seed_tensorboard(job.config.out, seed)) if job.dist_info.rank == 0 else None
    schedule = WarmupPolyDecay(job.total_steps, job.config.warmup_fraction, decay_power=1.0)
    engine = build_engine(load_model(job), job.ds, lr_schedule=schedule)
    skip_lone_rank_allreduce(engine, job.dist_info.world_size)
    result: dict[str, Any] = {"seed": seed, **train(engine, job, seed, writer), "scores": {}}
    engine.eval()
    folder = seed_dir(job.config.out, seed)
    for eval_set in job.task.evals:
        for kind, sets in (("dev", job.dev), ("test", job.test)):
            if eval_set.name not in sets:
                continue
            encoded = sets[eval_set.name]
            predictions = predict(engine, encoded, job)
            if predictions is None:
                continue
            write_predictions(job.task, folder / kind / eval_set.submission, encoded.indices, predictions)
            if kind == "dev":
                assert encoded.labels is not None
                scores = score(job.task, encoded.labels, predictions)
                result["scores"][eval_set.name] = scores
                for name, value in scores.items():
                    writer.add_scalar(f"glue/{eval_set.name}/{name}", value, job.total_steps)
    if job.config.save_model and writer is not None:  # ZeRO 0-2: rank 0's module holds every weight
        engine.module.save_pretrained(str(folder / MODEL))
    engine.destroy()
    del engine
    gc.collect()
    if writer is None:
        return None
    writer.close()
    atomic_write_json(folder / RESULTS, result)
    print(json.dumps({"seed": seed, **result["scores"]}), flush=True)
    return result


def summarise(job: Job, runs: list[dict[str, Any]], data: TaskData) -> dict[str, Any]:
    """Each seed, the median of every metric over the seeds, and the seed with the best mean dev score."""
    sets = [e.name for e in job.task.evals]
    median = {name: {metric: statistics.median(run["scores"][name][metric] for run in runs)
                     for metric in runs[0]["scores"][name]} for name in sets}
    best = max(runs, key=lambda run: statistics.fmean(run["scores"][name]["score"] for name in sets))
    submission = job.config.out / SUBMISSION
    if job.test:
        shutil.rmtree(submission, ignore_errors=True)
        shutil.copytree(seed_dir(job.config.out, best["seed"]) / "test", submission)
    return {
        "task": job.task.title, "model": str(job.config.model), "data": str(job.config.data),
        "world_size": job.dist_info.world_size, "precision": precision_of(job.ds),
        "optimizer": job.ds.get("optimizer", {}).get("type"), "lr": job.config.lr,
        "zero_stage": job.ds.get("zero_optimization", {}).get("stage", 0),
        "train_batch_size": job.ds["train_batch_size"], "train_steps": job.total_steps,
        "train_examples": len(job.train), "train_rows_skipped": data.train.skipped,
        "dev_examples": {name: len(encoded) for name, encoded in job.dev.items()},
        "test_examples": {name: len(encoded) for name, encoded in job.test.items()},
        "seeds": [run["seed"] for run in runs], "runs": runs, "median": median,
        "best_seed": best["seed"], "submission": sorted(p.name for p in submission.glob("*.tsv")) if job.test else [],
    }


def keep_best_model(out: Path, best_seed: int, tokenizer: Any) -> None:
    """--save-model: OUT/model is the seed best on dev, with the tokenizer (as submission/ holds its test files);
    the other seeds' models are removed (each was saved before the best was known)."""
    shutil.rmtree(out / MODEL, ignore_errors=True)
    os.replace(seed_dir(out, best_seed) / MODEL, out / MODEL)
    for folder in out.glob(f"seed-*/{MODEL}"):
        shutil.rmtree(folder)
    tokenizer.save_pretrained(str(out / MODEL))


def glue_texts(data: TaskData) -> Iterator[str]:
    """The raw text a fine-tune tokenizes: both sentences of every example (vocab_check samples them)."""
    for glue_set in (data.train, *data.dev.values(), *data.test.values()):
        for example in glue_set.examples:
            yield example.text_a
            if example.text_b is not None:
                yield example.text_b


def limited(data: TaskData, config: GlueConfig) -> TaskData:
    """--max-train-examples / --max-eval-examples applied (the first N rows of each set)."""
    def cut(glue_set: GlueSet, limit: int | None) -> GlueSet:
        return GlueSet(glue_set.source, glue_set.examples[:limit], glue_set.skipped) if limit else glue_set

    return TaskData(cut(data.train, config.max_train_examples),
                    {k: cut(v, config.max_eval_examples) for k, v in data.dev.items()},
                    {k: cut(v, config.max_eval_examples) for k, v in data.test.items()})


def check_inputs(config: GlueConfig) -> tuple[TaskData, dict[str, Any]]:
    """Everything a user can get wrong, checked before torch does any work: exit 2 with one line. Returns the
    task's data and the model's config.json (the tokenizer is checked against it once loaded)."""
    try:
        model_config = check_model_dir(config.model)
        if not config.ds_config.is_file():
            raise GlueFormatError(f"--ds-config {config.ds_config}: no such file")
        read_engine_json(config.ds_config)
    except (FinetuneFormatError, ConfigError) as err:
        raise GlueFormatError(str(err)) from None
    if config.max_seq_length > model_config.get("max_position_embeddings", 512):
        raise GlueFormatError(f"--max-seq-length {config.max_seq_length} exceeds max_position_embeddings "
                              f"{model_config.get('max_position_embeddings')} in {config.model / 'config.json'}")
    data = limited(load_task_data(config.glue_task, config.data), config)
    unlabelled = [s.source for s in (data.train, *data.dev.values()) if not s.labelled]
    if unlabelled:
        raise GlueFormatError(f"{unlabelled[0]}: has unlabelled rows; training and dev sets must be labelled")
    return data, model_config


def finetune(config: GlueConfig) -> dict[str, Any] | None:
    """The whole job: every seed; the summary (rank 0) or None (other ranks)."""
    data, model_config = check_inputs(config)
    from transformers import AutoTokenizer  # heavy imports only once the inputs are known to be good

    from pretrain.distributed.process_group import init_distributed

    dist_info = init_distributed()
    bf16_supported = dist_info.device.type == "cuda" and torch.cuda.is_bf16_supported()
    try:
        ds = engine_ds_config(config, dist_info.world_size, dist_info.device.type, bf16_supported)
    except ConfigError as err:
        raise GlueFormatError(str(err)) from None
    if config.save_model and ds.get("zero_optimization", {}).get("stage", 0) == 3:
        raise GlueFormatError(f"--save-model: not supported with ZeRO-3 ({config.ds_config}); use stage 0-2")
    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    # The model's own tokenizer, reading this text as words (not [UNK]s), checked before anything is tokenised.
    vocab = check_vocab(VocabCheck(tokenizer, config.model, model_config, glue_texts(data), config.allow_unk,
                                   GlueFormatError, speak=dist_info.rank == 0))
    length = config.max_seq_length
    train_set = encode(tokenizer, data.train, length)
    total_steps = config.max_steps or max(1, math.ceil(config.epochs * len(train_set) / ds["train_batch_size"]))
    job = Job(config, config.glue_task, train_set, {k: encode(tokenizer, v, length) for k, v in data.dev.items()},
              {k: encode(tokenizer, v, length) for k, v in data.test.items()}, ds, total_steps,
              tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, dist_info)
    runs = [run_seed(job, seed) for seed in config.seed_list]
    if dist_info.rank != 0:
        return None
    results = {**summarise(job, [run for run in runs if run is not None], data), "vocab_check": vocab.as_json()}
    if config.save_model:
        keep_best_model(config.out, results["best_seed"], tokenizer)
    atomic_write_json(config.out / RESULTS, results)
    print(json.dumps({"task": job.task.title, "seeds": results["seeds"], "median": results["median"]}), flush=True)
    return results


def summary_writer(path: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(path))
