"""Does a shard folder fit a phase? One function, `check_run_shards`, for the launch-time check
(pretrain/launch/preflight.py) and the rank's plan (pretrain/run_plan.py), so both say the same thing in
the same words, and each folder's manifest is read once per process (at 1,024 ranks on a shared
filesystem every extra read is a metadata storm).

Light: the standard library and the shard format's reader (pyarrow); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.atomic_io import sha256_file
from data_prep.shards import Manifest, ShardFormatError
from pretrain.config.sections import ConfigError, RunConfig

SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")  # what collate and masking look up in the vocab


@dataclass(frozen=True)
class PhaseShards:
    """What the launch-time check learned about one phase's shards (the ranks then open them for reading)."""

    manifest: Manifest
    vocab_size: int
    vocab_sha256: str
    max_predictions: int


def read_manifest(shards: str | Path, key: str) -> Manifest:
    """The folder's manifest, or a ConfigError naming `key` (data.shards or phaseN.shards) and the file."""
    try:
        return Manifest.load(shards)
    except ShardFormatError as err:
        raise ConfigError(f"{key}: {err}") from err


def check_phase_shards(
    shards: str | Path | Manifest, seq_len: int, max_predictions: int | None, key: str,
    expected_vocab_sha256: str | None = None, verify_checksums: bool = False,
) -> PhaseShards:
    """A phase's shard folder (or its manifest, already read) fits the run: manifest, sequence length, listed
    files, vocab, prediction slots.

    ConfigError naming `key` (data.shards or phaseN.shards) and the file. The shards are hashed only with
    `verify_checksums` (rank 0 at start-up; the launch-time check stays within seconds on any data size).
    """
    manifest = shards if isinstance(shards, Manifest) else read_manifest(shards, key)
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


def check_run_shards(config: RunConfig, verify_checksums: bool = False) -> dict[str, PhaseShards]:
    """check_phase_shards for every phase of the run, with one vocab for all of them; a folder two phases
    share is read once."""
    found: dict[str, PhaseShards] = {}
    manifests: dict[Path, Manifest] = {}
    vocab_sha = None
    for name, phase in config.phases():
        key = f"{name}.shards" if phase.shards else "data.shards"
        folder = phase.shards or config.data.shards
        same = Path(folder).resolve()  # the cache key; messages name the folder as the user spelled it
        if same not in manifests:
            manifests[same] = read_manifest(folder, key)
        found[name] = check_phase_shards(manifests[same], phase.seq_len, phase.max_predictions, key,
                                         expected_vocab_sha256=vocab_sha, verify_checksums=verify_checksums)
        vocab_sha = found[name].vocab_sha256
    return found


def model_overrides(config: RunConfig, vocab_size: int) -> tuple[dict[str, Any], int]:
    """`model.overrides` without vocab_size and max_position_embeddings, and the position count, both checked
    against the shards (vocab size) and the longest phase (positions)."""
    overrides = dict(config.model.overrides)
    if overrides.get("vocab_size", vocab_size) != vocab_size:
        raise ConfigError(
            f"model.overrides.vocab_size: {overrides['vocab_size']} differs from the shards' vocab size {vocab_size}"
        )
    overrides.pop("vocab_size", None)
    max_len = max(phase.seq_len for _, phase in config.phases())
    max_positions = overrides.pop("max_position_embeddings", max(512, max_len))
    if max_positions < max_len:
        raise ConfigError(f"model.overrides.max_position_embeddings: {max_positions} < seq_len {max_len}")
    return overrides, max_positions
