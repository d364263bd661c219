"""Does a shard folder fit a phase? The checks the launch-time check (pretrain/launch/preflight.py) and the ranks
(pretrain/data/batches.py `open_phase_data`) share, so both say the same thing in the same words.

Light: the standard library and the shard format's reader (pyarrow); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_prep.atomic_io import sha256_file
from data_prep.shards import Manifest, ShardFormatError
from pretrain.config.sections import ConfigError

SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")  # what collate and masking look up in the vocab


@dataclass(frozen=True)
class PhaseShards:
    """What the launch-time check learned about one phase's shards (the ranks then open them for reading)."""

    manifest: Manifest
    vocab_size: int
    vocab_sha256: str
    max_predictions: int


def check_phase_shards(
    shards: str | Path, seq_len: int, max_predictions: int | None, key: str,
    expected_vocab_sha256: str | None = None, verify_checksums: bool = False,
) -> PhaseShards:
    """A phase's shard folder fits the run: manifest, sequence length, listed files, vocab, prediction slots.

    ConfigError naming `key` (data.shards or phaseN.shards) and the file. The shards are hashed only with
    `verify_checksums` (rank 0 at start-up; the launch-time check stays within seconds on any data size).
    """
    try:
        manifest = Manifest.load(shards)
    except ShardFormatError as err:
        raise ConfigError(f"{key}: {err}") from err
    if seq_len not in manifest.seq_lens:
        raise ConfigError(
            f"{key}: {manifest.root} has no shards at sequence length {seq_len} (it has {manifest.seq_lens})"
        )
    try:
        manifest.verify(seq_len, "train", checksums=verify_checksums)
    except ShardFormatError as err:
        raise ConfigError(f"{key}: {err}") from err
    vocab_path = manifest.vocab_path
    if not vocab_path.is_file():
        raise ConfigError(f"{key}: vocab file {vocab_path} is missing")
    tokens = vocab_path.read_text(encoding="utf-8").splitlines()
    missing = [token for token in SPECIAL_TOKENS if token not in set(tokens)]
    if missing:
        raise ConfigError(f"{vocab_path}: vocab lacks the special tokens {missing}")
    sha = sha256_file(vocab_path)
    if sha != manifest.vocab_sha256 or len(tokens) != manifest.vocab_size:
        raise ConfigError(
            f"{key}: {vocab_path} (size {len(tokens)}, sha256 {sha[:12]}) differs from the "
            f"manifest's vocab (size {manifest.vocab_size}, sha256 {manifest.vocab_sha256[:12]})"
        )
    if expected_vocab_sha256 is not None and sha != expected_vocab_sha256:
        raise ConfigError(f"{key}: vocab sha256 {sha[:12]} differs from the model's vocab {expected_vocab_sha256[:12]}")
    from_manifest = manifest.data["masking"].get("max_predictions", {}).get(str(seq_len))
    predictions = max_predictions if max_predictions is not None else from_manifest
    if predictions is None:
        raise ConfigError(f"{key}: the manifest has no masking.max_predictions for {seq_len}; set max_predictions")
    if manifest.static_masking and from_manifest is not None and predictions < from_manifest:
        raise ConfigError(f"max_predictions: {predictions} is below the static shards' {from_manifest} at seq {seq_len}")
    return PhaseShards(manifest, len(tokens), sha, int(predictions))
