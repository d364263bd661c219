"""The tokenizer the shards were built with, as a file, and its fingerprint: a probe of real sentences and their ids.

The ids in the shards mean something only through the exact tokenizer that made them: the vocab, the
normalisation (lower-casing, accent stripping, text cleaning) and the WordPiece rules. The vocab file alone does
not carry the normalisation, and a library that rebuilds a tokenizer from it may silently build another one (the
transformers 5 `BertTokenizerFast(vocab_file=...)` of an earlier export kept 5 tokens and turned every word into
`[UNK]`). So a build writes, beside `vocab.txt`:

    OUT/tokenizer.json          the `tokenizers` object that tokenized the corpus, saved whole
    OUT/tokenizer_probe.json    {"sentences": [...], "ids": [[...], ...]}: a few hundred cleaned sentences of the
                                corpus and the ids data prep gave them (no [CLS]/[SEP])

and the manifest lists both with their sha256 (`manifest["tokenizer"]`). Whoever hands the model to a user (the
export) loads the tokenizer the way the user will and checks that it reproduces the probe (`probe_mismatch`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from data_prep.shard_format.atomic_io import atomic_write_bytes, atomic_write_json, sha256_file
from data_prep.shard_format.tokenizer_probe import PROBE_NAME, TOKENIZER_NAME, Probe, probe_mismatch
from data_prep.shard_format.vocab import Vocab

PROBE_SENTENCES = 256  # enough to meet most of a corpus's frequent words, accents and punctuation; ~100 KB
PROBE_POOL = 8192  # the probe is spread evenly over the first this-many sentences, not the first few paragraphs
PROBE_MAX_CHARS = 400  # longer sentences are skipped: the probe stays small and readable


def pick_probe_sentences(sentences: Iterable[str], count: int = PROBE_SENTENCES) -> list[str]:
    """`count` non-empty sentences spread evenly over the first PROBE_POOL of the corpus (deterministic: the order of
    the cleaned corpus is fixed whatever the number of workers or nodes)."""
    pool: list[str] = []
    for sentence in sentences:
        if sentence.strip() and len(sentence) <= PROBE_MAX_CHARS:
            pool.append(sentence)
            if len(pool) >= PROBE_POOL:
                break
    if len(pool) <= count:
        return pool
    return [pool[k * len(pool) // count] for k in range(count)]


def write_tokenizer_files(vocab: Vocab, sentences: Iterable[str], out: Path) -> dict[str, object]:
    """OUT/tokenizer.json and OUT/tokenizer_probe.json for `vocab` (with its lower-casing); returns the manifest's
    `tokenizer` entry."""
    tokenizer = vocab.tokenizer()  # built as the tokenize stage builds it (corpus_stage.py), so the same object
    atomic_write_bytes(out / TOKENIZER_NAME, tokenizer.to_str(pretty=True).encode("utf-8"))
    probe = Probe.made_by(tokenizer, pick_probe_sentences(sentences))
    saved = Tokenizer.from_file(str(out / TOKENIZER_NAME))
    mismatch = probe_mismatch(probe, lambda text: saved.encode(text, add_special_tokens=False).ids)
    if mismatch:  # `tokenizers` failed to round-trip its own file: no shard should claim it
        raise ValueError(f"{out / TOKENIZER_NAME}: does not tokenize as the tokenizer it was saved from: {mismatch}")
    atomic_write_json(out / PROBE_NAME, probe.to_json())
    return {
        "file": TOKENIZER_NAME, "sha256": sha256_file(out / TOKENIZER_NAME),
        "probe": PROBE_NAME, "probe_sha256": sha256_file(out / PROBE_NAME), "probe_sentences": len(probe.sentences),
    }
