"""The export's tokenizer: data prep's own `tokenizers` object, wrapped for transformers, and proven on reload.

A user loads an export with `AutoTokenizer.from_pretrained(folder)`. What they get must tokenize text exactly as the
shards were tokenized, or the model sees other ids than it was trained on (or, as with transformers 5's
`BertTokenizerFast(vocab_file=...)`, which ignores the argument, nothing but `[UNK]`). So the export does not rebuild
a tokenizer from the vocab through transformers' constructors, whose arguments change between releases: it wraps
the very `tokenizers` object data prep saved beside the shards (`tokenizer.json`; for older shards the same object
rebuilt from `vocab.txt` as data prep builds it), then loads the saved folder back the way a user does and refuses
the export unless

- `len(tokenizer)` is the vocab's size and the special tokens have the vocab's ids, and
- it gives data prep's ids to every sentence of the shards' probe (`tokenizer_probe.json`; older shards: a fixed set
  of sentences tokenized by data prep's tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from tokenizers import Tokenizer
from transformers import AutoTokenizer, BertTokenizer

from data_prep.shard_format.tokenizer_probe import FALLBACK_SENTENCES, Probe, probe_mismatch
from data_prep.shard_format.vocab import SPECIAL_TOKENS, Vocab, load_vocab


class TokenizerExportError(RuntimeError):
    """The tokenizer written into an export does not tokenize as the shards were tokenized; one line says how (the
    caller names the export)."""


@dataclass(frozen=True)
class SavedTokenizer:
    """What an export's tokenizer must prove on reload: the shards' vocab and the probe (and where it came from)."""

    vocab: Vocab
    probe: Probe
    probe_source: str  # "shards" (tokenizer_probe.json) or "fixed sentences" (shards older than the probe)


def data_prep_tokenizer(resolved: dict[str, Any]) -> tuple[Tokenizer, Vocab]:
    """The `tokenizers` object the shards were made with, and their vocab (lower-casing as data prep recorded it)."""
    vocab = load_vocab(resolved["vocab_file"])
    vocab = Vocab(vocab.path, vocab.tokens, bool(resolved.get("lowercase", vocab.lowercase)))
    saved = resolved.get("tokenizer_file")
    if saved:
        if not Path(saved).is_file():
            raise FileNotFoundError(f"{saved}: the tokenizer the shards were built with is missing")
        return Tokenizer.from_file(saved), vocab
    # shards older than tokenizer.json: rebuilt as data prep builds it (through the public serialised form)
    return Tokenizer.from_str(vocab.tokenizer().to_str()), vocab


def probe_of(resolved: dict[str, Any], tokenizer: Tokenizer) -> tuple[Probe, str]:
    """The shards' probe; for shards older than it, fixed sentences tokenized by data prep's tokenizer."""
    path = resolved.get("tokenizer_probe_file")
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: the tokenizer probe the shards were built with is missing")
        return Probe.load(path), "shards"
    return Probe.made_by(tokenizer, FALLBACK_SENTENCES), "fixed sentences"


def save_tokenizer(resolved: dict[str, Any], folder: Path, model_max_length: int) -> SavedTokenizer:
    """Write data prep's tokenizer into `folder` as transformers' BertTokenizer files (tokenizer.json,
    tokenizer_config.json) and vocab.txt; returns what the folder must reproduce (`check_saved_tokenizer`)."""
    tokenizer, vocab = data_prep_tokenizer(resolved)
    wrapped = BertTokenizer(tokenizer_object=tokenizer, do_lower_case=vocab.lowercase,
                            model_max_length=model_max_length)
    wrapped.save_pretrained(str(folder))
    (folder / "vocab.txt").write_bytes(vocab.path.read_bytes())  # for tools that want the plain WordPiece file
    return SavedTokenizer(vocab, *probe_of(resolved, tokenizer))


def check_saved_tokenizer(folder: Path, saved: SavedTokenizer) -> dict[str, Any]:
    """Load `folder`'s tokenizer as a user would and prove it is the shards' one; raises TokenizerExportError.
    Returns what was checked, for export_info.json."""
    vocab, probe = saved.vocab, saved.probe
    loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    version = f"transformers {transformers.__version__}"
    if len(loaded) != vocab.size:
        raise TokenizerExportError(
            f"its tokenizer loads with {len(loaded)} tokens, the shards' vocab {vocab.path} has {vocab.size} "
            f"({version})")
    ids = {token: loaded.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    if ids != vocab.special_ids:
        raise TokenizerExportError(f"its tokenizer's special token ids are {ids}, the vocab's are {vocab.special_ids} ({version})")
    mismatch = probe_mismatch(probe, lambda text: loaded(text, add_special_tokens=False)["input_ids"])
    if mismatch:
        raise TokenizerExportError(f"its tokenizer does not tokenize as data prep did: {mismatch} ({version})")
    return {"class": type(loaded).__name__, "size": len(loaded), "probe_sentences": len(probe.sentences),
            "probe_source": saved.probe_source, "checked_with": version}
