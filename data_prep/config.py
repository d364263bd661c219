"""The build configuration: typed, validated once, recorded in the manifest.

`identity()` is the part that decides the output bytes; a folder built with another identity is
refused instead of being mixed. How the work is spread (workers, nodes) is not part of it,
because the output does not depend on it.

The inputs follow data_prep/sources.py's `SOURCES` table, which this module cannot import: it is
a floor that every stage of the build imports, and the readers pull in the wikitext parser. So the
five sources that existed before the table keep their named fields (every build_config.json written so far
records them, and callers construct them by name), and every source added since keeps its values in `inputs` by
its row's field: a new source needs no edit here.

Its flags' errors are the run's `ConfigError` (pretrain/errors.py, the ground floor, standard library only), one
class for both tools: data_prep/__main__.py prints one as one line, "error: " and the message, and exits 2.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from data_prep.shard_format.modes import MASKING_MODES, NSP, SEGMENT_MODES, max_predictions_for
from pretrain.errors import ConfigError

# Where NSP draws a random next segment from (data_prep/instance_stage.py): the document's own input shard, as
# google-research/bert's create_pretraining_data.py does when run once per input file, or the whole corpus.
NSP_SCOPE_SHARD, NSP_SCOPE_CORPUS = "shard", "corpus"
NSP_SCOPES = (NSP_SCOPE_SHARD, NSP_SCOPE_CORPUS)
# How static masking draws (--mask-draws): google-research/bert's `random.Random` sequence, the bytes every static
# build so far has, or the numpy engine the ranks' dynamic masking uses (data_prep/shard_format/masking.py): the
# same rule, other draws, several times faster; the instances themselves are then those of a dynamic build.
GOOGLE_DRAWS, NUMPY_DRAWS = "google", "numpy"
MASK_DRAWS = (GOOGLE_DRAWS, NUMPY_DRAWS)
# Input bytes (on disk: compressed files count compressed) per input shard, the unit of work and NSP's pool.
DEFAULT_INPUT_SHARD_MB = 256.0
# The input fields that predate the SOURCES table (tests/data_prep/test_sources.py matches them to its rows).
NAMED_INPUTS = ("wiki_dumps", "wikiextractor", "books", "texts", "hf_datasets")


# MediaWiki refuses to save a page over 2 MiB ($wgMaxArticleSize, 2048 KiB), so no real Wikipedia page is longer.
MAX_WIKITEXT_CHARS = 2 << 20


@dataclass(frozen=True)
class DocumentLimits:
    """Caps on one input document, so that no input, hostile or vandalised, costs more than linear time and
    bounded memory: a document over a cap is skipped and counted under --skip-bad-files, else the build
    stops with one line naming it. Fixed settings (not flags, not part of the identity): no real document
    reaches them, so they change no byte of a build of real data.

    - `max_document_bytes`: a document's bytes on disk before decoding: a book file (decompressed), one
      JSON or text line, one WikiExtractor `<doc>`; also what a read takes at most at a time.
    - `max_wikitext_chars`: a Wikipedia page's wikitext (MediaWiki's own limit, above).
    - `max_markup_cost`: the wikitext parser (mwparserfromhell, a C extension) rescans the rest of a page for
      every opener it cannot close (`{{`, `[[`, `{|`, `[`, a tag), so a page of unclosed openers takes
      quadratic time (23 KiB of unclosed templates: 11 s). Such pages are found before parsing, in linear
      time: unclosed openers times the page's length above this is refused (balanced real pages are at 0;
      at the cap, a page costs the parser some seconds on this project's CI machine).
    - `parse_seconds`: a last resort, per document, for a cost the count above does not see (the worker's
      timer interrupts the parser). Far above any real page (a 2 MiB page takes about 5 s; the slowest linear
      markup, 2 MiB of `''`, about 70 s on this project's CI machine), because a document it stops makes the
      output depend on the machine's speed; such a stop says so in its message.
    """

    max_document_bytes: int = 64 << 20
    max_wikitext_chars: int = MAX_WIKITEXT_CHARS
    max_markup_cost: int = 1 << 24
    parse_seconds: float = 300.0


DEFAULT_LIMITS = DocumentLimits()


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class BuildConfig:
    out: str
    wiki_dumps: tuple[str, ...] = ()
    wikiextractor: tuple[str, ...] = ()
    books: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()
    hf_datasets: tuple[str, ...] = ()
    hf_text_field: str = "text"
    hf_rows_per_doc: int = 1
    # Sources added since the table: (row field, values as recorded: paths absolute), and the options of
    # those given, (option field, value). Recorded in the identity only when not empty, so that every
    # folder started before a source existed still resumes.
    inputs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    input_options: tuple[tuple[str, Any], ...] = ()
    skip_bad_files: bool = False  # unreadable files, and a folder's files of no kind it reads: skip, named
    vocab: str | None = None
    vocab_size: int | None = None
    lowercase: bool = True  # only for a trained vocab; a given vocab decides for itself
    seq_lens: tuple[int, ...] = (128, 512)
    masking: str = "dynamic"
    mask_draws: str = GOOGLE_DRAWS  # static masking only; recorded only when not the default
    segments: str = NSP
    dupe_factor: int = 1
    mask_prob: float = 0.15
    whole_word: bool = False
    short_seq_prob: float = 0.1
    val_fraction: float = 0.0
    num_shards: int = 8
    num_val_shards: int = 1
    seed: int = 12345
    min_doc_chars: int = 100
    docs_per_chunk: int = 256
    # Input files are grouped, in read order, into input shards of about this many MiB; a larger file is one
    # shard of its own. Recorded in the identity only when not the default (as `segments`).
    input_shard_mb: float = DEFAULT_INPUT_SHARD_MB
    nsp_scope: str = NSP_SCOPE_SHARD  # recorded only when not the default
    # Not part of the identity: how the work is spread.
    workers: int = field(default_factory=default_workers)
    num_nodes: int = 1
    node_rank: int = 0
    # A node of a multi-node build waits for the other nodes' tasks of a stage before it runs its share of the
    # next one, giving up (the rest is left to `merge`) when none finished for this many seconds; 0: no wait.
    node_wait: float = 600.0
    # Keep OUT/work/ (the cleaned text, tokens, instances and markers) once the manifest is written; by default
    # the build removes the files it wrote there (2-3x the output's size), as they are of no further use.
    keep_work: bool = False

    def __post_init__(self) -> None:
        # One order whatever order the caller (or a recorded identity's sorted keys) gave.
        object.__setattr__(self, "inputs", tuple(sorted((name, tuple(v)) for name, v in self.inputs)))
        object.__setattr__(self, "input_options", tuple(sorted(self.input_options)))
        if not any(getattr(self, name) for name in NAMED_INPUTS) and not any(v for _, v in self.inputs):
            # the command line names every flag (data_prep/__main__.py); this is for other callers
            raise ConfigError("no input: give at least one source (the inputs of `python -m data_prep build --help`)")
        if (self.vocab is None) == (self.vocab_size is None):
            raise ConfigError("give exactly one of --vocab FILE or --vocab-size N")
        if self.vocab_size is not None and not 10 <= self.vocab_size <= 1 << 20:
            raise ConfigError(f"--vocab-size {self.vocab_size}: must be between 10 and 1048576")
        if not self.seq_lens or any(not 8 <= s <= 65535 for s in self.seq_lens):
            raise ConfigError(f"--seq-lens {self.seq_lens}: each must be between 8 and 65535")
        if len(set(self.seq_lens)) != len(self.seq_lens):
            raise ConfigError(f"--seq-lens {self.seq_lens}: repeated value")
        if self.masking not in MASKING_MODES:
            raise ConfigError(f"--masking {self.masking!r}: expected one of {MASKING_MODES}")
        if self.segments not in SEGMENT_MODES:
            raise ConfigError(f"--segments {self.segments!r}: expected one of {', '.join(SEGMENT_MODES)}")
        if self.mask_draws not in MASK_DRAWS:
            raise ConfigError(f"--mask-draws {self.mask_draws!r}: expected one of {', '.join(MASK_DRAWS)}")
        if self.mask_draws != GOOGLE_DRAWS and not self.static_masking:
            raise ConfigError(f"--mask-draws {self.mask_draws}: goes with --masking static (dynamic shards are "
                              "masked by the ranks)")
        if self.nsp_scope not in NSP_SCOPES:
            raise ConfigError(f"--nsp-scope {self.nsp_scope!r}: expected one of {', '.join(NSP_SCOPES)}")
        checks = [
            ("--dupe-factor", self.dupe_factor >= 1, self.dupe_factor),
            ("--mask-prob", 0 < self.mask_prob < 1, self.mask_prob),
            ("--short-seq-prob", 0 <= self.short_seq_prob <= 1, self.short_seq_prob),
            ("--val-fraction", 0 <= self.val_fraction < 1, self.val_fraction),
            ("--num-shards", self.num_shards >= 1, self.num_shards),
            ("--num-val-shards", self.num_val_shards >= 1, self.num_val_shards),
            ("--min-doc-chars", self.min_doc_chars >= 0, self.min_doc_chars),
            ("--docs-per-chunk", self.docs_per_chunk >= 1, self.docs_per_chunk),
            ("--input-shard-mb", self.input_shard_mb > 0, self.input_shard_mb),
            ("--workers", self.workers >= 1, self.workers),
            ("--num-nodes", self.num_nodes >= 1, self.num_nodes),
            ("--node-rank", 0 <= self.node_rank < self.num_nodes, self.node_rank),
            ("--node-wait", self.node_wait >= 0, self.node_wait),
        ]
        for flag, ok, value in checks:
            if not ok:
                raise ConfigError(f"{flag} {value}: out of range")
        if self.num_nodes > 1 and self.vocab is None:
            raise ConfigError(
                "--num-nodes > 1 needs a fixed --vocab FILE (every node must tokenize with the same vocab); "
                "train one first with a single-node build, or pass an existing vocab.txt"
            )

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def input_shard_bytes(self) -> int:
        return max(1, round(self.input_shard_mb * (1 << 20)))

    @property
    def static_masking(self) -> bool:
        return self.masking == "static"

    def max_predictions(self) -> dict[str, int]:
        return {str(s): max_predictions_for(s, self.mask_prob) for s in self.seq_lens}

    def input_values(self, name: str) -> tuple[str, ...]:
        """The values of the SOURCES row with field `name`, wherever this config keeps them."""
        return getattr(self, name) if name in NAMED_INPUTS else dict(self.inputs).get(name, ())

    def input_option(self, name: str, default: Any) -> Any:
        """A source option's value: a named field (the HF options), or `input_options`, else its default."""
        if name in {f.name for f in fields(self)}:
            return getattr(self, name)
        return dict(self.input_options).get(name, default)

    def identity(self) -> dict[str, Any]:
        """Everything that decides the output bytes (paths made absolute).

        `segments`, `nsp_scope`, `input_shard_mb` and `mask_draws` only when not the default: a folder started before
        they existed recorded no such key, and its manifest's `config` stays as it was."""
        data = asdict(self)
        for key in ("out", "workers", "num_nodes", "node_rank", "node_wait", "keep_work"):
            data.pop(key)
        for key, default in (("segments", NSP), ("nsp_scope", NSP_SCOPE_SHARD),
                             ("input_shard_mb", DEFAULT_INPUT_SHARD_MB), ("mask_draws", GOOGLE_DRAWS)):
            if data[key] == default:
                data.pop(key)
        inputs, options = data.pop("inputs"), data.pop("input_options")
        if inputs:  # as `segments`: absent from folders started before any newer source existed
            data["inputs"] = {name: list(values) for name, values in inputs}
        if options:
            data["input_options"] = dict(options)
        for key in ("wiki_dumps", "wikiextractor", "books", "texts"):
            data[key] = [str(Path(p).resolve()) for p in data[key]]
        data["hf_datasets"] = list(data["hf_datasets"])
        data["seq_lens"] = list(data["seq_lens"])
        if data["vocab"] is not None:
            data["vocab"] = str(Path(data["vocab"]).resolve())
        return data

    @classmethod
    def from_identity(cls, identity: dict[str, Any], **runtime: Any) -> BuildConfig:
        names = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in identity.items() if k in names}
        values["inputs"] = tuple(identity.get("inputs", {}).items())
        values["input_options"] = tuple(identity.get("input_options", {}).items())
        return cls(**values, **runtime)
