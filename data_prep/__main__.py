"""`python -m data_prep build | merge | task | inspect` — see docs/data_prep.md."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from data_prep.config import (
    DEFAULT_INPUT_SHARD_MB,
    GOOGLE_DRAWS,
    MASK_DRAWS,
    NSP,
    NSP_SCOPE_SHARD,
    NSP_SCOPES,
    SEGMENT_MODES,
    BuildConfig,
    ConfigError,
    default_workers,
)
from data_prep.sources import SOURCES


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_prep", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="raw corpora -> BERT pretraining shards + manifest.json",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = build.add_argument_group("inputs (at least one; read in this order)")
    for row in SOURCES:
        src.add_argument(row.flag, action="append", default=[], metavar=row.metavar, help=row.help)
        for option in row.options:
            src.add_argument(option.flag, type=option.type, default=option.default, help=option.help)
    src.add_argument("--skip-bad-files", action="store_true",
                     help=f"skip (with a warning) {'/'.join(r.flag for r in SOURCES if r.skips_bad_files)} files "
                          "that are not UTF-8 or unreadable (--jsonl: lines), files of a folder of no kind it reads "
                          "(named), and any source's documents over a "
                          "cap per document (size, markup cost; counted in the manifest), instead of stopping")
    voc = build.add_argument_group("vocabulary (exactly one)")
    voc.add_argument("--vocab", metavar="FILE", help="WordPiece vocab.txt; casing follows the vocab")
    voc.add_argument("--vocab-size", type=int, metavar="N", help="train a WordPiece vocab of N tokens on the corpus")
    voc.add_argument("--cased", action="store_true", help="with --vocab-size: keep case and accents")
    inst = build.add_argument_group("instances")
    inst.add_argument("--seq-lens", type=_int_list, default=(128, 512), help="comma-separated sequence lengths")
    # No argparse `choices`: a bad value is then one `error: --segments ...` line, not a usage dump.
    inst.add_argument("--segments", default=NSP, metavar="|".join(SEGMENT_MODES),
                      help="nsp: BERT's sentence pairs + next-sentence labels; full-sentences: RoBERTa's whole "
                           "sentences packed up to the length across documents ([SEP] between documents), "
                           "MLM only; doc-sentences: the same within one document")
    inst.add_argument("--nsp-scope", default=NSP_SCOPE_SHARD, metavar="|".join(NSP_SCOPES),
                      help="nsp: where a random next segment comes from: the document's input shard (as "
                           "google-research/bert run once per input file) or the whole corpus")
    inst.add_argument("--masking", choices=("dynamic", "static"), default="dynamic",
                      help="dynamic: stored unmasked, masked at load time; static: masked here")
    inst.add_argument("--mask-draws", choices=MASK_DRAWS, default=GOOGLE_DRAWS,
                      help="static masking's draws: google (google-research/bert's sequence, the default) or numpy "
                           "(the ranks' vectorised masker: the same rule, other bytes, faster)")
    inst.add_argument("--dupe-factor", type=int, default=1, help="passes over the corpus with different draws")
    inst.add_argument("--mask-prob", type=float, default=0.15,
                      help="fraction of tokens to predict (80%% [MASK], 10%% random, 10%% kept); the cap per "
                           "instance follows it: 20 at 128 for 0.15, 40 for 0.30")
    inst.add_argument("--whole-word", action="store_true", help="static masking: mask whole words")
    inst.add_argument("--short-seq-prob", type=float, default=0.1,
                      help="nsp: probability of a shorter target length (the packed modes do not use it)")
    inst.add_argument("--min-doc-chars", type=int, default=100, help="drop (and count) shorter documents")
    out = build.add_argument_group("output")
    out.add_argument("--out", required=True, metavar="DIR", help="output folder (new, or one this config started)")
    out.add_argument("--val-fraction", type=float, default=0.0, help="fraction of documents held out for validation")
    out.add_argument("--num-shards", type=int, default=8, help="training shards per sequence length (equal +-1)")
    out.add_argument("--num-val-shards", type=int, default=1, help="validation shards per sequence length")
    out.add_argument("--seed", type=int, default=12345, help="seed of every random choice")
    out.add_argument("--docs-per-chunk", type=int, default=256,
                     help="input documents per unit of work (part of the output's identity)")
    out.add_argument("--input-shard-mb", type=float, default=DEFAULT_INPUT_SHARD_MB,
                     help="input files are grouped in read order into input shards of about this many MiB on disk "
                          "(a larger file is one shard): the unit of work and the NSP pool (part of the identity)")
    run = build.add_argument_group("execution (does not change the output)")
    run.add_argument("--workers", type=int, default=default_workers(), help="worker processes")
    run.add_argument("--num-nodes", type=int, default=1, help="machines sharing the work (then run merge)")
    run.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..num-nodes-1")
    run.add_argument("--node-wait", type=float, default=600.0, metavar="SECONDS",
                     help="with --num-nodes: how long a node waits, with no other node finishing a task, for the "
                          "stage before its next share (then it leaves the rest to merge); 0: no wait")
    run.add_argument("--keep-work", action="store_true",
                     help="keep OUT/work/ (cleaned text, tokens, instances, markers: 2-3x the output) once the manifest "
                          "is written; by default the build removes the files it wrote there")
    run.add_argument("--slurm", action="store_true",
                     help="submit the build as SLURM job arrays (one element per task, then the merge) and return")
    run.add_argument("--print-sbatch", action="store_true",
                     help="with --slurm: print the batch scripts and the sbatch commands instead of submitting")
    run.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                     help="with --slurm: an #SBATCH option for every job (e.g. --partition=cpu); repeatable")
    run.add_argument("--array-throttle", type=int, metavar="N",
                     help="with --slurm: at most N elements of each array run at once (SLURM's --array=...%%N)")
    for kind, example in (("cpus", "corpus=16"), ("mem", "gather=8G"), ("time", "instances=4:00:00")):
        run.add_argument(f"--stage-{kind}", action="append", default=[], metavar="STAGE=VALUE",
                         help=f"with --slurm: the {kind} of each job of a stage (corpus, instances, scatter, gather, "
                              f"merge), e.g. {example}; repeatable")

    merge = commands.add_parser("merge", help="after a multi-node build: instances, shards and the manifest")
    merge.add_argument("--out", required=True, metavar="DIR")
    merge.add_argument("--workers", type=int, default=default_workers())
    merge.add_argument("--keep-work", action="store_true",
                       help="keep OUT/work/ (cleaned text, tokens, instances, markers: 2-3x the output) once the manifest "
                          "is written; by default the build removes the files it wrote there")

    task = commands.add_parser("task", help="one task of a started build (what a SLURM array element runs)")
    task.add_argument("stage", choices=("corpus", "instances", "scatter", "gather"))
    task.add_argument("--out", required=True, metavar="DIR")
    task.add_argument("--index", type=int, required=True,
                      help="the task: input shard (corpus), instance task, scatter task or output shard (gather)")
    task.add_argument("--count", type=int, default=1,
                      help="corpus: the input shards --index .. --index + N - 1, run --workers at a time")
    task.add_argument("--workers", type=int, default=default_workers())

    inspect = commands.add_parser("inspect", help="manifest statistics and decoded random instances")
    inspect.add_argument("out", metavar="OUT")
    inspect.add_argument("--num-examples", type=int, default=3, help="decoded instances per sequence length")
    inspect.add_argument("--seed", type=int, default=0)
    return parser


def source_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config's inputs, row by row of SOURCES: the named fields of the sources that predate the
    table, and `inputs` / `input_options` for the rest (only those given, so the identity of a build
    without them stays what it was)."""
    given = {row.field: tuple(getattr(args, row.dest)) for row in SOURCES}
    if not any(given.values()):
        raise ConfigError(f"no input: give at least one of {', '.join(row.flag for row in SOURCES)}")
    named = {f.name for f in fields(BuildConfig)}
    settings: dict[str, Any] = {}
    inputs: list[tuple[str, tuple[str, ...]]] = []
    options: list[tuple[str, Any]] = []
    for row in SOURCES:
        values = given[row.field]
        if row.field in named:
            settings[row.field] = values
        elif values:
            inputs.append((row.field, row.recorded(values)))
        for option in row.options:
            value = getattr(args, option.dest)
            if option.field in named:
                settings[option.field] = value
            elif values:
                options.append((option.field, value))
    return {**settings, "inputs": tuple(inputs), "input_options": tuple(options)}


def config_from_args(args: argparse.Namespace) -> BuildConfig:
    return BuildConfig(
        out=args.out, **source_settings(args), skip_bad_files=args.skip_bad_files,
        vocab=args.vocab, vocab_size=args.vocab_size, lowercase=not args.cased,
        seq_lens=args.seq_lens, masking=args.masking, mask_draws=args.mask_draws, segments=args.segments,
        dupe_factor=args.dupe_factor,
        mask_prob=args.mask_prob,
        whole_word=args.whole_word, short_seq_prob=args.short_seq_prob, val_fraction=args.val_fraction,
        num_shards=args.num_shards, num_val_shards=args.num_val_shards, seed=args.seed,
        min_doc_chars=args.min_doc_chars, docs_per_chunk=args.docs_per_chunk,
        input_shard_mb=args.input_shard_mb, nsp_scope=args.nsp_scope,
        workers=args.workers, num_nodes=args.num_nodes, node_rank=args.node_rank, node_wait=args.node_wait,
        keep_work=args.keep_work,
    )


def main(argv: list[str] | None = None, configure_threads: bool = False) -> int:
    """The CLI. `configure_threads` (the command line only, not in-process callers such as tests,
    whose other code may use `tokenizers` too) sizes the tokenizers thread pool to --workers."""
    args = build_parser().parse_args(argv)
    if configure_threads and getattr(args, "workers", None):
        # Threads of `tokenizers` (read once, when its pool starts): as many as worker processes.
        os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))
    # Imported after parsing so that `--help` is instant.
    from data_prep.array_tasks import run_task
    from data_prep.build import BuildError, run_build, run_merge
    from data_prep.report import inspect_text
    from data_prep.shard_format.shards import ShardFormatError
    from data_prep.shard_format.vocab import VocabError
    from data_prep.slurm_arrays import submit_build
    from data_prep.slurm_settings import SlurmSettings
    from data_prep.source_files import SourceError

    try:
        if args.command == "build" and args.slurm:
            slurm = SlurmSettings.parse(args.array_throttle, args.stage_cpus, args.stage_mem, args.stage_time)
            submit_build(config_from_args(args), args.sbatch_arg, args.print_sbatch, slurm)
        elif args.command == "build":
            if (args.print_sbatch or args.sbatch_arg or args.array_throttle is not None or args.stage_cpus
                    or args.stage_mem or args.stage_time):
                raise ConfigError("--print-sbatch, --sbatch-arg, --array-throttle and --stage-* go with --slurm")
            run_build(config_from_args(args))
        elif args.command == "task":
            run_task(Path(args.out), args.stage, args.index, args.workers, args.count)
        elif args.command == "merge":
            run_merge(Path(args.out), args.workers, args.keep_work)
        else:
            print(inspect_text(Path(args.out), args.num_examples, args.seed))
    except (ConfigError, SourceError, VocabError, ShardFormatError, BuildError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(configure_threads=True))
