"""The plan: the input files in read order, grouped into input shards, the build's unit of work.

An input shard is a run of consecutive input files (in SOURCES' order, a folder's files sorted) of about
`--input-shard-mb` MiB on disk; a larger file is a shard of its own, and a Hugging Face dataset (a name, not
files) is one shard. Every stage is a set of tasks over input shards (clean and tokenize one shard, make one
shard's instances at one length), so each input byte is read by exactly one task, on whichever node runs
it, and NSP draws its random next segment within the shard by default, as google-research/bert's
create_pretraining_data.py does when run once per input file.

The plan is written to work/plan.json by the first process of a build and checked by every later one: an
input file added, removed, grown or touched since is refused, naming the file and what changed, because
the shards already made from it would no longer be the shards of the inputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from itertools import chain
from pathlib import Path

from data_prep.byte_ranges import cut_points, splittable
from data_prep.bz2_streams import BZ2_STREAMS, stream_cuts
from data_prep.config import BuildConfig
from data_prep.parquet_source import ROW_GROUPS, check_text_column, row_group_cuts
from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.source_files import SourceError, list_text_files
from data_prep.sources import FILE, FOLDER, NAME, SOURCES, RawDocument, ReadContext
from data_prep.work_layout import plan_path

PLAN_FORMAT = "input-shards-v1"


class PlanError(ValueError):
    """The inputs changed since the plan was made, or the plan was made with another unit size."""


@dataclass(frozen=True)
class InputUnit:
    """One input file (or one dataset name) and what the plan saw of it."""

    source: str  # the SOURCES row's field
    value: str  # the flag's value as the config records it (a folder for FOLDER rows)
    file: str | None  # the file read: the value itself (FILE), one file of the folder (FOLDER), None (NAME)
    size: int | None
    mtime_ns: int | None
    start: int = 0  # a byte range of the file (a large plain file cut at document starts); end None: to its end
    end: int | None = None

    def describe(self) -> str:
        row = next(r for r in SOURCES if r.field == self.source)
        return f"{row.flag} {self.file or self.value}"

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end is None

    @property
    def bytes(self) -> int | None:
        """Bytes this unit reads on disk (None: a dataset name)."""
        if self.size is None:
            return None
        return (self.size if self.end is None else self.end) - self.start

    def label(self) -> str:
        """The file (and range) in a marker."""
        where = self.file or self.value
        return where if self.whole else f"{where}@{self.start}-{self.end if self.end is not None else self.size}"


@dataclass(frozen=True)
class InputPlan:
    shard_bytes: int
    shards: tuple[tuple[InputUnit, ...], ...]

    def to_json(self) -> dict:
        return {"format": PLAN_FORMAT, "input_shard_bytes": self.shard_bytes,
                "shards": [[asdict(unit) for unit in shard] for shard in self.shards]}

    @classmethod
    def from_json(cls, data: dict) -> InputPlan:
        return cls(int(data["input_shard_bytes"]),
                   tuple(tuple(InputUnit(**unit) for unit in shard) for shard in data["shards"]))

    @property
    def num_shards(self) -> int:
        return len(self.shards)


def input_units(cfg: BuildConfig) -> list[InputUnit]:
    """Every input file in the build's read order (the order documents, and so chunks, follow); a plain file
    larger than an input shard, of a source whose documents can be told apart from their bytes, as byte ranges
    of about an input shard each, cut at document starts (data_prep/byte_ranges.py) or, for parquet, at row-group
    starts (data_prep/parquet_source.py)."""
    units: list[InputUnit] = []
    for row in SOURCES:
        for value in cfg.input_values(row.field):
            # Resolved, as the config records values: the merge and SLURM tasks, which rebuild the config
            # from build_config.json, must see the same paths as the build that wrote the plan.
            root = Path(value).resolve() if row.kind != NAME else None
            if row.kind == FILE:
                files: list[Path | None] = [root]
            elif row.kind == FOLDER:
                files = list(list_text_files(root, row.flag, row.suffixes))  # links inside keep their names
            else:
                files = [None]
            for path in files:
                stat = path.stat() if path is not None else None
                unit = InputUnit(row.field, str(root) if root is not None else value, str(path) if path else None,
                                 stat.st_size if stat else None, stat.st_mtime_ns if stat else None)
                if row.cut_at == ROW_GROUPS and path is not None and not _parquet_usable(path, cfg):
                    units.append(unit)  # left out by its reader, with a warning (--skip-bad-files)
                else:
                    units += cut_unit(unit, row.cut_at, cfg.input_shard_bytes)
    return units


def _parquet_usable(path: Path, cfg: BuildConfig) -> bool:
    """The file is parquet with the text column (checked before any work), or under --skip-bad-files False."""
    try:
        check_text_column(path, cfg.input_option("parquet_text_field", "text"))
    except SourceError:
        if not cfg.skip_bad_files:
            raise
        return False
    return True


def cut_unit(unit: InputUnit, cut_at: str | None, shard_bytes: int) -> list[InputUnit]:
    """`unit` as byte ranges of about `shard_bytes` when it is a larger file that can be cut (plain, not compressed;
    parquet; a multistream .bz2 dump); else itself."""
    if cut_at is None or unit.file is None or unit.size is None or unit.size <= shard_bytes:
        return [unit]
    pieces = -(-unit.size // shard_bytes)
    if cut_at == ROW_GROUPS:
        cuts = row_group_cuts(Path(unit.file), shard_bytes)
    elif cut_at == BZ2_STREAMS:  # a multistream dump; a plain .xml one stays whole
        if not unit.file.endswith(".bz2"):
            return [unit]
        cuts = stream_cuts(Path(unit.file), unit.size, pieces)
    elif splittable(Path(unit.file)):
        cuts = cut_points(Path(unit.file), unit.size, pieces, cut_at)
    else:
        return [unit]
    bounds = [0, *cuts, None]
    return [replace(unit, start=bounds[k], end=bounds[k + 1]) for k in range(len(bounds) - 1)]


def group_shards(units: list[InputUnit], shard_bytes: int) -> tuple[tuple[InputUnit, ...], ...]:
    """Consecutive units while they fit `shard_bytes`; a unit larger than that, or without a size (a
    dataset name), is a shard of its own."""
    shards: list[list[InputUnit]] = []
    filled = shard_bytes  # forces a new shard for the first unit
    for unit in units:
        size = unit.bytes
        if size is None or filled + size > shard_bytes or not shards:
            shards.append([unit])
            filled = size if size is not None else shard_bytes
        else:
            shards[-1].append(unit)
            filled += size
    return tuple(tuple(shard) for shard in shards)


def make_plan(cfg: BuildConfig) -> InputPlan:
    return InputPlan(cfg.input_shard_bytes, group_shards(input_units(cfg), cfg.input_shard_bytes))


def load_plan(out: Path) -> InputPlan:
    return InputPlan.from_json(json.loads(plan_path(out).read_text(encoding="utf-8")))


def ensure_plan(cfg: BuildConfig) -> InputPlan:
    """The recorded plan when the inputs are still what it saw, else PlanError naming the first change;
    written on the first call (nodes starting together write the same bytes, atomically)."""
    plan = make_plan(cfg)
    recorded_path = plan_path(cfg.out_dir)
    if not recorded_path.is_file():
        atomic_write_json(recorded_path, plan.to_json())
        return plan
    recorded = load_plan(cfg.out_dir)
    if recorded != plan:
        raise PlanError(f"--out {cfg.out_dir}: {plan_change(recorded, plan)}; the shards begun from the "
                        "old inputs cannot be finished from these: restore them, or use another --out")
    return recorded


def plan_change(before: InputPlan, after: InputPlan) -> str:
    """The first difference between two plans, in words."""
    if before.shard_bytes != after.shard_bytes:
        return f"input shard size changed ({before.shard_bytes} -> {after.shard_bytes} bytes)"
    old = {(u.source, u.file or u.value, u.start): u for u in chain.from_iterable(before.shards)}
    new = {(u.source, u.file or u.value, u.start): u for u in chain.from_iterable(after.shards)}
    for key, unit in new.items():
        if key not in old:
            return f"{unit.describe()}: added since the build began"
        for name in ("size", "mtime_ns"):
            if getattr(old[key], name) != getattr(unit, name):
                return (f"{unit.describe()}: changed since the build began "
                        f"({name} {getattr(old[key], name)} -> {getattr(unit, name)})")
    for key, unit in old.items():
        if key not in new:
            return f"{unit.describe()}: gone since the build began"
    return "the input order changed since the build began"


def read_shard(cfg: BuildConfig, units: tuple[InputUnit, ...]) -> Iterator[RawDocument]:
    """The documents of one input shard in order: only its own files are opened."""
    rows = {row.field: row for row in SOURCES}
    for unit in units:
        row = rows[unit.source]
        context = ReadContext(cfg.skip_bad_files, {o.field: cfg.input_option(o.field, o.default) for o in row.options})
        if not unit.whole:
            assert row.read_range is not None and unit.file is not None
            yield from row.read_range(Path(unit.file), Path(unit.value), context, unit.start, unit.end)
        elif row.kind == FOLDER:
            assert row.read_file is not None and unit.file is not None
            yield from row.read_file(Path(unit.file), Path(unit.value), context)
        else:
            yield from row.read(unit.file or unit.value, context)
