"""`./launch.sh demo`: the whole pipeline at toy scale on 2 CPU ranks, in about ten minutes.

prep (WordPiece vocab trained on the corpus, seq 64/128 shards) -> phase 1 + phase 2 of a tiny
BERT on a 2-rank DeepSpeed ZeRO-2 engine with our LAMB -> Hugging Face export -> SQuAD fine-tune
and EM/F1 on a dev set, beside the same fine-tune from random weights (run at the same time on the
core the first leaves idle) -> the run's report (run/report.md + report.png; the model card gets the
scores) -> a closing summary table that puts the F1 next to that baseline and next to the published
full-recipe figure.

Every step is a `./launch.sh` subcommand, so the demo runs exactly what a user would run and
prints it; nothing here trains or tokenizes itself. Data it can reach, in this order:

1. ``--sample-data DIR`` laid out like ``shared/data`` (wikipedia/*.xml.bz2, books/*/ *.txt,
   squad/{train,dev}-v1.1-subset.json);
2. the Wikipedia dump that ships inside the ``gensim`` wheel (``pip install '.[demo]'``);
3. Hugging Face datasets, when huggingface.co answers;
4. otherwise a message that says what to provide.

SQuAD needs local files (``DIR/squad``) or a network; without either the demo stops after
pretraining and export, and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.demo.steps import Step, StopSignal, finish_background, install_signal_handlers, run_step
from pretrain.demo.summary import (
    BASELINE_EVALUATE,
    BASELINE_FINETUNE,
    RANDOM_SQUAD_DIR,
    render_table,
    summary_rows,
)
from pretrain.run_folder import CHECKPOINTS

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH_SH = REPO_ROOT / "launch.sh"
GENSIM_WIKI_DUMP = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# Small enough to download in seconds: 2M tokens of Wikipedia articles.
HF_PRETRAINING_DATASET = "Salesforce/wikitext:wikitext-2-raw-v1"
HF_SQUAD_DATASET = "rajpurkar/squad"
SQUAD_TRAIN_NAME = "train-v1.1-subset.json"
SQUAD_DEV_NAME = "dev-v1.1-subset.json"

# Toy scale: a vocab and sequence lengths a 2-core CPU gets through in minutes.
DEMO_VOCAB_SIZE = 8192
DEMO_SEQ_LENS = (64, 128)
DEMO_RANKS = 2
# SQuAD at the demo's scale: short windows (the model saw seq <= 128), a slice of the train subset.
# One process (--launcher none): batch 4 = micro-batch 4, lr 1e-3 (a tiny model learns fast; the flag
# defaults, 3e-5 and 32, are BERT's GPU fine-tune).
SQUAD_DEMO_FLAGS = (
    "--ds-config", str(REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json"),
    "--lr", "1e-3", "--batch-size", "4",
    "--max-seq-length", "128", "--doc-stride", "64",
    "--max-steps", "150", "--max-train-examples", "600", "--log-every", "25",
)  # fmt: skip
# The demo's RUN.json: bert-mini, seq 64 then 128, ZeRO-2 + ExactLamb from ds_configs/deepspeed/lamb_zero2_cpu.json.
# Step counts are sized for the 10-minute budget on 2 cores; pretrain_overrides() sets the folders.
DEMO_RUN_CONFIG = Path(__file__).with_name("demo_run.json")  # shipped with the package (pyproject.toml)


class DemoDataError(RuntimeError):
    """No usable data source: the message says what to provide."""


@dataclass(frozen=True)
class PretrainingSource:
    kind: str  # "sample-data" | "gensim" | "huggingface"
    prep_args: tuple[str, ...]  # data_prep build flags that select the corpus
    description: str


@dataclass(frozen=True)
class SquadSource:
    kind: str  # "sample-data" | "huggingface"
    train: Path
    dev: Path
    description: str
    needs_download: bool = False


def find_gensim_wiki_dump() -> Path | None:
    """The enwiki sample inside an installed gensim, found without importing gensim (slow, scipy)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        dump = Path(location) / GENSIM_WIKI_DUMP
        if dump.is_file():
            return dump
    return None


def network_available(host: str = "huggingface.co", port: int = 443, timeout: float = 3.0) -> bool:
    """True when the Hugging Face Hub answers and offline mode is not requested."""
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(flag, "").strip().lower() in {"1", "true", "yes", "on"}:
            return False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _sample_wiki_dumps(sample_data: Path) -> list[Path]:
    wiki = sample_data / "wikipedia"
    return sorted(p for p in wiki.glob("*.xml*") if p.is_file()) if wiki.is_dir() else []


def _sample_book_folders(sample_data: Path) -> list[Path]:
    books = sample_data / "books"
    if not books.is_dir():
        return []
    return sorted(d for d in books.iterdir() if d.is_dir() and any(d.glob("*.txt")))


def resolve_pretraining_source(
    sample_data: Path | None, gensim_dump: Path | None, network: bool, use_books: bool = True
) -> PretrainingSource:
    """Pick the corpus in the documented order; an explicit --sample-data that is wrong is an error."""
    if sample_data is not None:
        if not sample_data.is_dir():
            raise DemoDataError(f"--sample-data: '{sample_data}' is not a folder")
        dumps = _sample_wiki_dumps(sample_data)
        if not dumps:
            raise DemoDataError(
                f"--sample-data: no Wikipedia dump in '{sample_data / 'wikipedia'}' "
                "(expected *.xml or *.xml.bz2, laid out like shared/data)"
            )
        args = [arg for dump in dumps for arg in ("--wiki-dump", str(dump))]
        books = _sample_book_folders(sample_data) if use_books else []
        args += [arg for folder in books for arg in ("--books", str(folder))]
        if books:
            # Sample book sets can hold a non-UTF-8 file (NLTK's Gutenberg has one Latin-1 book):
            # skip it with a warning rather than stop the demo.
            args.append("--skip-bad-files")
        described = f"{len(dumps)} Wikipedia dump(s)" + (f" + {len(books)} book folder(s)" if books else "")
        return PretrainingSource("sample-data", tuple(args), f"{described} from {sample_data}")
    if gensim_dump is not None:
        return PretrainingSource(
            "gensim",
            ("--wiki-dump", str(gensim_dump)),
            f"the enwiki sample shipped in gensim ({gensim_dump})",
        )
    if network:
        return PretrainingSource(
            "huggingface",
            # wikitext stores one paragraph per row: 50 rows make a document with sentence pairs for NSP.
            ("--hf-dataset", HF_PRETRAINING_DATASET, "--hf-rows-per-doc", "50"),
            f"Hugging Face dataset {HF_PRETRAINING_DATASET} (downloaded)",
        )
    raise DemoDataError(
        "no pretraining data found. Provide one of:\n"
        "  --sample-data DIR   a folder laid out like shared/data (wikipedia/*.xml.bz2, books/, squad/)\n"
        "  pip install -e '.[demo]'   gensim's wheel ships a 206-page Wikipedia dump the demo finds itself\n"
        "  a network connection     the demo then downloads a small Hugging Face dataset"
    )


def resolve_squad_source(sample_data: Path | None, network: bool, out_dir: Path) -> SquadSource | None:
    """Local SQuAD files first, then a small download; None means: stop after pretraining."""
    if sample_data is not None:
        train, dev = sample_data / "squad" / SQUAD_TRAIN_NAME, sample_data / "squad" / SQUAD_DEV_NAME
        if train.is_file() and dev.is_file():
            return SquadSource("sample-data", train, dev, f"SQuAD v1.1 subsets from {train.parent}")
    if network:
        folder = out_dir / "squad_data"
        return SquadSource(
            "huggingface",
            folder / SQUAD_TRAIN_NAME,
            folder / SQUAD_DEV_NAME,
            f"SQuAD v1.1 subsets of {HF_SQUAD_DATASET} (downloaded)",
            needs_download=True,
        )
    return None


def download_squad_subset(source: SquadSource, train_articles: int = 8, dev_articles: int = 1) -> None:
    """Write the first articles of SQuAD v1.1 from the Hub in the official JSON layout."""
    from datasets import load_dataset

    for split, path, limit in (
        ("train", source.train, train_articles),
        ("validation", source.dev, dev_articles),
    ):
        articles: dict[str, dict[str, list[dict]]] = {}
        for row in load_dataset(HF_SQUAD_DATASET, split=split):
            if row["title"] not in articles and len(articles) == limit:
                break
            paragraphs = articles.setdefault(row["title"], {})
            qa = {
                "id": row["id"],
                "question": row["question"],
                "answers": [
                    {"text": text, "answer_start": start}
                    for text, start in zip(
                        row["answers"]["text"], row["answers"]["answer_start"], strict=True
                    )
                ],
            }
            paragraphs.setdefault(row["context"], []).append(qa)
        data = [
            {"title": title, "paragraphs": [{"context": c, "qas": qas} for c, qas in paragraphs.items()]}
            for title, paragraphs in articles.items()
        ]
        atomic_write_json(path, {"version": "1.1", "data": data})


def pretrain_overrides(data_dir: Path, run_dir: Path) -> list[str]:
    """Point the driver's tiny CPU run config at the demo's shards and run folder."""
    return [f"--data.shards={data_dir}", f"--run.dir={run_dir}"]


def build_steps(
    out: Path, corpus: PretrainingSource, squad: SquadSource | None, ranks: int, overrides: list[str]
) -> list[Step]:
    launch = str(LAUNCH_SH)
    data_dir, run_dir, model_dir, squad_dir = out / "data", out / "run", out / "model", out / "squad"
    prep_flags = {
        "--vocab-size": DEMO_VOCAB_SIZE, "--seq-lens": ",".join(map(str, DEMO_SEQ_LENS)),
        "--masking": "dynamic", "--dupe-factor": 1, "--val-fraction": 0.02, "--num-shards": ranks,
        "--out": data_dir, "--seed": 1234, "--workers": min(2, os.cpu_count() or 1),
    }  # fmt: skip
    steps = [
        Step("prep", lambda: [launch, "prep", *corpus.prep_args, *_flags(prep_flags)]),
        Step(
            "pretrain",
            lambda: [
                launch, "pretrain", "--cpu", "--gpus", str(ranks), "--master-port", str(_free_port()),
                "--config", str(DEMO_RUN_CONFIG), *pretrain_overrides(data_dir, run_dir), *overrides,
            ],  # fmt: skip
        ),
        Step("export", lambda: [launch, "export", str(final_checkpoint(run_dir)), str(model_dir)]),
    ]
    if squad is not None:
        squad_flags = {"--model": model_dir, "--train": squad.train, "--dev": squad.dev, "--out": squad_dir}
        random_flags = {**squad_flags, "--out": out / RANDOM_SQUAD_DIR}
        finetune = [launch, "squad", "finetune", "--cpu", "--launcher", "none"]
        steps += [
            # The same fine-tune from random weights: what pretraining bought, on the second core.
            Step(BASELINE_FINETUNE, lambda: [*finetune, *_flags(random_flags), *SQUAD_DEMO_FLAGS, "--random-init"],
                 background=True),
            Step("squad finetune", lambda: [*finetune, *_flags(squad_flags), *SQUAD_DEMO_FLAGS]),
            Step("squad evaluate", lambda: [launch, "squad", "evaluate", str(squad.dev), str(squad_dir / "predictions.json")]),
            Step(BASELINE_EVALUATE, lambda: [launch, "squad", "evaluate", str(squad.dev),
                                             str(out / RANDOM_SQUAD_DIR / "predictions.json")],
                 waits_for=BASELINE_FINETUNE),
        ]
    # Last: the run written up (curves, time to target, the config, the SQuAD scores beside it), and the
    # exported model's card regenerated with those scores.
    steps.append(Step("report", lambda: [launch, "report", str(run_dir)]))
    return steps


def _flags(values: dict[str, object]) -> list[str]:
    return [item for flag, value in values.items() for item in (flag, str(value))]


def final_checkpoint(run_dir: Path) -> Path:
    """The driver's checkpoint folder (checkpoint.dir default); export follows its `latest`."""
    return run_dir / CHECKPOINTS


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's flags; anything after `--` is a `--section.key=value` override for pretraining."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="./launch.sh demo",
        description=__doc__.split("\n\n")[0],
        epilog="Pretraining overrides go after --, e.g. ./launch.sh demo -- --phase1.steps=40",
    )
    parser.add_argument("--sample-data", type=Path, help="a folder laid out like shared/data")
    parser.add_argument("--out", type=Path, help="output folder (default: runs/demo-<time>)")
    parser.add_argument(
        "--with-books",
        action="store_true",
        help="also the books under --sample-data's books/ (BERT's second corpus; adds prep time)",
    )
    parser.add_argument("--ranks", type=int, default=DEMO_RANKS, help="CPU ranks for pretraining")
    parser.add_argument("--dry-run", action="store_true", help="print the steps' commands, run nothing")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    for override in overrides:
        if not (override.startswith("--") and "." in override.split("=")[0] and "=" in override):
            parser.error(f"after --: {override!r} is not a --section.key=value override")
    args.overrides = overrides
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = (args.out or REPO_ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    sample_data = args.sample_data.resolve() if args.sample_data else None
    gensim_dump = None if sample_data else find_gensim_wiki_dump()
    needs_network = sample_data is None and gensim_dump is None
    network = network_available() if needs_network or not _has_local_squad(sample_data) else False
    try:
        corpus = resolve_pretraining_source(sample_data, gensim_dump, network, use_books=args.with_books)
    except DemoDataError as error:
        print(f"demo: {error}", file=sys.stderr)
        return 2
    squad = resolve_squad_source(sample_data, network, out)
    print(f"demo: pretraining data: {corpus.description}")
    print(
        f"demo: SQuAD: {squad.description if squad else 'none (no local files, no network): stops after export'}"
    )
    print(f"demo: outputs in {out}")

    started = time.monotonic()
    steps = build_steps(out, corpus, squad, args.ranks, args.overrides)
    if squad is not None and squad.needs_download and not args.dry_run:
        download_squad_subset(squad)
    background = {step.name: step for step in steps if step.background}
    install_signal_handlers()
    try:
        for step in steps:
            if step.waits_for:
                finish_background(background[step.waits_for], out / "logs")
            run_step(step, out / "logs", args.dry_run)
    except StopSignal as stop:
        print(f"{stop}; its log is in {out / 'logs'}", file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        for step in background.values():
            if step.process is not None and step.process.poll() is None:
                step.process.terminate()  # a failed step ends the demo; nothing it started outlives it
                step.process.wait()
    if args.dry_run:
        return 0
    rows = summary_rows(out, steps, corpus.description, squad.description if squad else None)
    rows.append(("total time", f"{time.monotonic() - started:.0f} s"))
    print(render_table(rows))
    if squad is None:
        print(
            "\nSQuAD skipped: no squad/ folder in --sample-data and no network. "
            "Pass --sample-data with squad/train-v1.1-subset.json and dev-v1.1-subset.json to score EM/F1."
        )
    return 0


def _has_local_squad(sample_data: Path | None) -> bool:
    return sample_data is not None and (sample_data / "squad" / SQUAD_DEV_NAME).is_file()


if __name__ == "__main__":
    sys.exit(main())
