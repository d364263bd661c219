"""What the fine-tune commands (pretrain/finetune/squad, pretrain/finetune/glue) share: flags from a typed config, the engine dict.

One home per setting, as in pretraining (pretrain/config/deepspeed.py): a fine-tune's flags own lr, schedule,
batch sizes and precision; its DeepSpeed JSON (--ds-config) holds engine mechanics only, and one that
sets an owned key is refused naming the flag. Both commands declare their flags once, as the fields
of a frozen dataclass (``flag``), and ``add_config_arguments`` builds the command line from them, so
the flags and their documentation cannot drift apart. The flags both share (the engine's JSON, the
batch arithmetic, the warmup, the precision) are declared here once (``EngineFlags``), and so is
the command-line plumbing (``FinetuneCommand``, ``finetune_subcommand``).

One rank has nothing to partition: ``engine_ds_config`` runs an fp32 fine-tune on a world of one
without ZeRO (``without_lone_rank_zero``), and ``skip_lone_rank_allreduce`` spares the engine its
gradient all-reduce there.

No torch here, and numpy only inside ``micro_batches``: ``--help`` and the scorers stay light.
Errors are ``ConfigError`` (one line naming the flag or file); each command turns them into its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from pretrain.config.deepspeed import (
    deep_merge,
    precision_of,
    read_ds_json,
    refuse_owned_keys,
    resolve_batch,
    resolve_precision,
)
from pretrain.errors import ConfigError, FinetuneFormatError

REPO_ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
VOCAB_FILES = ("tokenizer.json", "vocab.txt")

# Where the settings a fine-tune's DeepSpeed JSON must not set live: the finetune flags.
FINETUNE_OWNERS = {"batch_size": "--batch-size", "micro_batch_size": "--micro-batch-size",
                   "gradient_accumulation_steps": "--gradient-accumulation-steps", "lr": "--lr",
                   "precision": "--precision", "schedule": "--warmup-fraction"}
BATCH_FLAGS = ("--batch-size", "--micro-batch-size", "--gradient-accumulation-steps")


def check_model_dir(path: Path) -> dict:
    """Return the Hugging Face BERT folder's config.json before anything heavy is loaded (no torch);
    raise a FinetuneFormatError naming what is missing or wrong."""
    if not path.is_dir():
        raise FinetuneFormatError(f"--model {path}: not a folder (expected a Hugging Face BERT checkpoint folder)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FinetuneFormatError(f"--model {path}: no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise FinetuneFormatError(f"{config_path}: malformed JSON: {err}") from None
    if not isinstance(config, dict):
        raise FinetuneFormatError(f"{config_path}: expected a JSON object")
    if config.get("model_type") not in (None, "bert"):
        raise FinetuneFormatError(f"{config_path}: model_type is {config.get('model_type')!r}; this fine-tuner needs a BERT")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise FinetuneFormatError(f"--model {path}: no weights (looked for {', '.join(WEIGHT_FILES)})")
    if not any((path / name).is_file() for name in VOCAB_FILES):
        raise FinetuneFormatError(f"--model {path}: no vocabulary (looked for {', '.join(VOCAB_FILES)})")
    return config


class EngineSettings(Protocol):
    """The flags an engine dict is built from (FinetuneConfig in squad, GlueConfig in glue)."""

    ds_config: Path
    lr: float
    batch_size: int
    micro_batch_size: int | None
    gradient_accumulation_steps: int | None
    precision: str


def read_engine_json(ds_config: Path) -> dict[str, Any]:
    """--ds-config read and refused when it sets what a flag owns (no process group needed: checked early)."""
    where = f"--ds-config {ds_config}"
    ds = read_ds_json(ds_config, where)
    refuse_owned_keys(ds, where, FINETUNE_OWNERS, home="the command line", fix="pass {}")
    return ds


def engine_ds_config(settings: EngineSettings, world_size: int, device_type: str,
                     bf16_supported: bool) -> dict[str, Any]:
    """The engine's dict: the JSON's mechanics + the flags' lr, batch for `world_size` ranks and precision."""
    ds = read_engine_json(settings.ds_config)
    ds = deep_merge(ds, {"optimizer": {"params": {"lr": settings.lr}}})
    accumulation = settings.gradient_accumulation_steps
    if accumulation is None and settings.micro_batch_size is None:
        accumulation = 1  # the whole global batch in one micro-batch per rank
    ds.update(resolve_batch(settings.batch_size, settings.micro_batch_size, accumulation, world_size, BATCH_FLAGS))
    ds = resolve_precision(quiet_timers(ds), settings.precision, device_type, bf16_supported)
    return without_lone_rank_zero(ds, world_size)


def without_lone_rank_zero(ds: dict[str, Any], world_size: int) -> dict[str, Any]:
    """ZeRO stage 0 for an fp32 fine-tune on one rank whose JSON asks for stage 1 or 2 (and no offload).

    ZeRO-1/2 partition the optimizer state over the ranks; on one rank there is one partition, and
    the wrapper's bookkeeping is pure cost: each step it copies every gradient into a flat buffer,
    takes a norm per parameter and copies the updated flat master weights back (0.82x a plain torch
    AdamW loop on MiniLM, docs/squad.md). Without it the engine steps the torch optimizer on the
    module's own parameters. The same JSON keeps its stage on several ranks, where partitioning saves
    memory. With bf16/fp16 the stage stays too: there the wrapper keeps the fp32 master weights that
    mixed precision needs anyway (and our LAMB refuses low precision at stage 0). Offloading needs ZeRO.
    """
    zero = ds.get("zero_optimization")
    if world_size != 1 or precision_of(ds) != "fp32" or not isinstance(zero, dict):
        return ds
    if zero.get("stage", 0) not in (1, 2) or any(key.startswith("offload") for key in zero):
        return ds
    return {**ds, "zero_optimization": {"stage": 0}}


def skip_lone_rank_allreduce(engine: Any, world_size: int) -> None:
    """No gradient all-reduce on a one-rank engine without ZeRO: exact, and one flatten + copy back less.

    DeepSpeed's stage-0 engine all-reduces the gradients after every backward even in a world of one:
    it flattens them into buckets, reduces (a sum over one rank, divided by 1) and copies them back.
    ``enable_backward_allreduce`` is the engine's own switch for engines that reduce elsewhere.
    """
    if world_size == 1 and engine.zero_optimization_stage() == 0:
        engine.enable_backward_allreduce = False


def quiet_timers(ds: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's throughput timer off unless the JSON turns it on.

    Enabled by default, it synchronises the device at the start and the end of every step (two host
    syncs a step on a GPU) to print a samples/s figure we never print (steps_per_print is huge). An
    explicit ``"timers": {"throughput": {"enabled": true}}`` in the JSON is kept.
    """
    timers = ds.get("timers", {})
    throughput = timers.get("throughput", {}) if isinstance(timers, dict) else None
    if not isinstance(throughput, dict) or "enabled" in throughput:
        return ds  # set by the JSON (or malformed: DeepSpeed names it)
    return deep_merge(ds, {"timers": {"throughput": {"enabled": False}}})


def micro_batches(num_items: int, micro: int, world_size: int, rank: int, seed: int) -> Iterator[list[int]]:
    """This rank's micro-batches, forever: one shuffled pass per epoch, the same order on every rank.

    Each round hands ``micro`` consecutive indices of the stream to each rank, so the ranks of one
    round see disjoint items, and together they see every item once per epoch (a round that
    crosses an epoch boundary finishes with the next epoch's first items).
    """
    import numpy as np

    per_round = micro * world_size
    epoch = 0
    stream = np.empty(0, dtype=np.int64)
    position = 0
    while True:
        while len(stream) - position < per_round:
            fresh = np.random.default_rng([seed, epoch]).permutation(num_items)
            stream = np.concatenate([stream[position:], fresh])
            position = 0
            epoch += 1
        mine = stream[position + rank * micro : position + (rank + 1) * micro]
        position += per_round
        yield mine.tolist()


def flag(default: Any, doc: str, choices: tuple[Any, ...] | None = None, required: bool = False) -> Any:
    """A config field with what its command-line flag needs (doc, choices, required)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "choices": choices, "required": required})


# BERT's fine-tuning optimizer (torch AdamW, betas 0.9/0.999, eps 1e-6, weight decay 0.01), ZeRO-1 on several
# ranks, clipping at 1.0: one JSON for SQuAD and GLUE alike; a second copy would be a second home.
DEFAULT_DS_CONFIG = REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json"


@dataclasses.dataclass(frozen=True)
class EngineFlags:
    """The flags every fine-tune shares, declared once: its engine's JSON, the batch arithmetic, the warmup,
    the precision. A command's config (FinetuneConfig in squad, GlueConfig in glue) subclasses it and adds
    its own, epochs and lr among them (their defaults differ per task). A bad value raises the command's
    ``format_error``, one line naming the flag."""

    format_error: typing.ClassVar[type[FinetuneFormatError]] = FinetuneFormatError
    # The words each command's help fills in (``flag_doc``), so both read as they did before the flags were shared.
    items: typing.ClassVar[str] = "items"  # what a batch holds
    steps_scope: typing.ClassVar[str] = ""
    json_hint: typing.ClassVar[str] = ""

    ds_config: Path = flag(DEFAULT_DS_CONFIG, "DeepSpeed JSON of engine mechanics: optimizer type and its other "
                                              "params, ZeRO, clipping{json_hint}; it must not set lr, batch sizes, "
                                              "bf16/fp16.enabled or a scheduler: the flags here own them")
    max_steps: int | None = flag(None, "optimizer steps{steps_scope} (overrides --epochs)")
    batch_size: int = flag(32, "global batch: training {items} per optimizer step, all ranks together")
    micro_batch_size: int | None = flag(None, "{items} per rank per forward/backward; None: --batch-size / "
                                              "(ranks x accumulation)")
    gradient_accumulation_steps: int | None = flag(None, "micro-batches per rank per optimizer step; None: derived "
                                                         "from --micro-batch-size, or 1 without it")
    warmup_fraction: float = flag(0.1, "share of the steps with a linear warmup (then linear decay to 0)")
    precision: str = flag("auto", "auto: fp32 on CPU, bf16 on a GPU that has it, else fp16 (dynamic loss scale)",
                          choices=PRECISIONS)

    @classmethod
    def flag_doc(cls, spec: dataclasses.Field) -> str:
        """A field's help as this command prints it (a shared flag's doc with the command's words)."""
        doc = spec.metadata["doc"]
        if spec.name in {shared.name for shared in dataclasses.fields(EngineFlags)}:
            return doc.format(items=cls.items, steps_scope=cls.steps_scope, json_hint=cls.json_hint)
        return doc

    def check_engine_flags(self) -> None:
        """Each count > 0 when set, the warmup share in [0, 1), a known precision."""
        for name in ("max_steps", "batch_size", "micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise self.format_error(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise self.format_error(f"--warmup-fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.precision not in PRECISIONS:
            raise self.format_error(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type) -> None:
    """`--name-with-dashes` for every field of `config_class` (declared with ``flag``): type, default, choices, doc.

    --help reads: the required flags, the command's own, then the engine's it shares (EngineFlags)."""
    hints = typing.get_type_hints(config_class)
    shared = {spec.name for spec in dataclasses.fields(EngineFlags)}
    ordered = sorted(dataclasses.fields(config_class),
                     key=lambda spec: (not spec.metadata.get("required"), spec.name in shared))
    for spec in ordered:
        option = "--" + spec.name.replace("_", "-")
        doc = config_class.flag_doc(spec) if issubclass(config_class, EngineFlags) else spec.metadata["doc"]
        kind = hints[spec.name]
        if kind is bool:
            parser.add_argument(option, action="store_true", help=doc)
            continue
        options = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        extra: dict[str, Any] = {"choices": spec.metadata["choices"]} if spec.metadata.get("choices") else {}
        if spec.metadata.get("required"):
            extra["required"] = True
        else:
            extra["default"] = spec.default
            doc += " (default: %(default)s)"
        parser.add_argument(option, type=options[0], help=doc, **extra)
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment instead.
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace, config_class: type) -> Any:
    fields = {name: getattr(args, name) for name in config_class.__dataclass_fields__ if hasattr(args, name)}
    return config_class(**fields)


def check_positive(values: dict[str, float | int | None]) -> None:
    """ConfigError naming the first flag (by its field name) whose value is set and not > 0."""
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """One subcommand of a fine-tune command: its help line, its flags and what runs it (each a callable,
    handed in by the command's own ``__main__``: this module names no fine-tune package)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def finetune_subcommand(help_line: str, config_class: type,
                        load_finetune: Callable[[], Callable[[Any], Any]]) -> Subcommand:
    """The ``finetune`` subcommand of a command: its flags are `config_class`'s fields, and it runs
    ``load_finetune()(config)``. `load_finetune` imports the command's fine-tune (torch, transformers,
    DeepSpeed) when it runs, so --help and ``evaluate`` stay light."""

    def run(args: argparse.Namespace) -> int:
        load_finetune()(config_from_args(args, config_class))
        return 0

    return Subcommand(help_line, lambda parser: add_config_arguments(parser, config_class), run)


@dataclasses.dataclass(frozen=True)
class FinetuneCommand:
    """`python -m pretrain.finetune.<task> {evaluate,finetune}`: the plumbing both commands share.

    A bad input file or flag (a FinetuneFormatError) is one line on stderr and exit 2."""

    prog: str
    description: str
    evaluate: Subcommand
    finetune: Subcommand

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        commands = parser.add_subparsers(dest="command", required=True)
        for name, command in (("evaluate", self.evaluate), ("finetune", self.finetune)):
            command.add_arguments(commands.add_parser(name, help=command.help))
        return parser

    def main(self, argv: list[str] | None = None) -> int:
        args = self.parser().parse_args(argv)
        command = self.evaluate if args.command == "evaluate" else self.finetune
        try:
            return command.run(args)
        except FinetuneFormatError as err:
            print(err.line(), file=sys.stderr)
            return 2

    def exit(self) -> None:
        """``python -m``'s entry: run the command line, exit with its status."""
        sys.exit(self.main())
