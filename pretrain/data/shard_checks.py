"""Does a shard folder fit a phase? `check_phase_shards` on plain values (a folder or its manifest, a sequence
length, the prediction slots), which the run's one shard loop (pretrain/plan/shard_plan.py: every phase of a
RunConfig, for the launch-time check and the rank's plan alike) and the data stream (batches.py) share, so each
says the same thing in the same words. Nothing here reads the run config: that is the plan's floor.

Light: the standard library and the shard format's reader (pyarrow); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_prep.shard_format.modes import max_predictions_for
from data_prep.shard_format.shards import SPLITS, Manifest, ShardFormatError
from data_prep.shard_format.vocab import Vocab, VocabError
from pretrain.data.shard_values import ShardValueError, ValueLimits, check_shard
from pretrain.errors import ConfigError


@dataclass(frozen=True)
class PhaseShards:
    """What the launch-time check learned about one phase's shards (the ranks then open them for reading)."""

    manifest: Manifest
    vocab: Vocab  # read once, here: the ranks mask and collate with it
    max_predictions: int
    mask_prob: float  # the MLM rate the phase trains at (data.mask_probability, else the shards')

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def vocab_sha256(self) -> str:
        return self.vocab.sha256

    @property
    def trains_nsp(self) -> bool:
        """Sentence-pair shards (data_prep --segments nsp) train MLM + NSP; packed ones MLM alone."""
        return self.manifest.next_sentence_labels


def read_manifest(shards: str | Path, key: str) -> Manifest:
    """The folder's manifest, or a ConfigError naming `key` (data.shards or phaseN.shards) and the file."""
    try:
        return Manifest.load(shards)
    except ShardFormatError as err:
        raise ConfigError(f"{key}: {err}") from err


def check_phase_shards(
    shards: str | Path | Manifest, seq_len: int, max_predictions: int | None, key: str,
    expected_vocab_sha256: str | None = None, verify_checksums: bool = False, mask_probability: float | None = None,
) -> PhaseShards:
    """A phase's shard folder (or its manifest, already read) fits the run: manifest, sequence length, listed
    files, vocab, prediction slots.

    ConfigError naming `key` (data.shards or phaseN.shards) and the file. The shards are hashed and their values
    checked (ids below the vocab size, static masked positions inside their instance: shard_values.py) only with
    `verify_checksums` (rank 0 at start-up; the launch-time check stays within seconds on any data size).
    """
    manifest = shards if isinstance(shards, Manifest) else read_manifest(shards, key)
    if seq_len not in manifest.seq_lens:
        raise ConfigError(
            f"{key}: {manifest.root} has no shards at sequence length {seq_len} (it has {manifest.seq_lens})"
        )
    try:
        manifest.verify(seq_len, "train", checksums=False)  # listed files exist; bytes and values below
    except ShardFormatError as err:
        raise ConfigError(f"{key}: {err}") from err
    vocab_path = manifest.vocab_path
    if not vocab_path.is_file():
        raise ConfigError(f"{key}: vocab file {vocab_path} is missing")
    try:
        vocab = Vocab.load(vocab_path)
    except VocabError as err:
        raise ConfigError(f"{key}: {err}") from err
    sha = vocab.sha256
    if sha != manifest.vocab_sha256 or vocab.size != manifest.vocab_size:
        raise ConfigError(
            f"{key}: {vocab_path} (size {vocab.size}, sha256 {sha[:12]}) differs from the "
            f"manifest's vocab (size {manifest.vocab_size}, sha256 {manifest.vocab_sha256[:12]})"
        )
    if expected_vocab_sha256 is not None and sha != expected_vocab_sha256:
        raise ConfigError(f"{key}: vocab sha256 {sha[:12]} differs from the model's vocab {expected_vocab_sha256[:12]}")
    if verify_checksums:
        check_shard_files(manifest, ValueLimits(vocab_size=vocab.size, seq_len=seq_len), key)
    rate = masking_rate(manifest, mask_probability, key)
    from_manifest = manifest.data["masking"].get("max_predictions", {}).get(str(seq_len))
    if mask_probability is not None and from_manifest is not None and not manifest.static_masking:
        from_manifest = max(from_manifest, max_predictions_for(seq_len, rate))  # room for the higher rate
    predictions = max_predictions if max_predictions is not None else from_manifest
    if predictions is None:
        raise ConfigError(f"{key}: the manifest has no masking.max_predictions for {seq_len}; set max_predictions")
    if manifest.static_masking and from_manifest is not None and predictions < from_manifest:
        raise ConfigError(f"max_predictions: {predictions} is below the static shards' {from_manifest} at seq {seq_len}")
    return PhaseShards(manifest, vocab, int(predictions), rate)


def check_shard_files(manifest: Manifest, limits: ValueLimits, key: str) -> None:
    """Every shard of the phase's sequence length, training and held-out: its sha256 as the manifest lists it,
    and its values inside `limits`. ConfigError naming `key`, the file, and for a value its row and the value."""
    by_split = manifest.data["seq_lens"][str(limits.seq_len)]
    for split in (split for split in SPLITS if split in by_split):
        for info in manifest.shards(limits.seq_len, split):
            try:
                check_shard(manifest.root / info.file, info.sha256, limits)
            except ShardValueError as err:
                raise ConfigError(f"{key}: {err}") from err


def masking_rate(manifest: Manifest, mask_probability: float | None, key: str) -> float:
    """The share of tokens masked: `data.mask_probability` for dynamic shards (masked as they are read), else
    the rate the shards were built with (data_prep --mask-prob). Static shards hold their masks: another
    rate is refused, naming both."""
    built = float(manifest.data["masking"].get("mask_prob", 0.15))
    if mask_probability is None or mask_probability == built:
        return built
    if manifest.static_masking:
        raise ConfigError(f"data.mask_probability: {mask_probability}, but {key} ({manifest.root}) holds static masks "
                          f"made at {built} (data_prep --mask-prob); rebuild them, or build dynamic shards "
                          "(--masking dynamic) to choose the rate here")
    return float(mask_probability)


def check_one_objective(found: dict[str, PhaseShards], keys: dict[str, str]) -> None:
    """Every phase's shards were built the same way (data_prep --segments): one run trains one objective.
    ConfigError naming the two folders and their modes."""
    names = list(found)
    for name in names[1:]:
        first, other = found[names[0]].manifest, found[name].manifest
        if other.segments != first.segments:
            raise ConfigError(f"{keys[name]}: {other.root} was built with --segments {other.segments}, {keys[names[0]]} "
                            f"({first.root}) with --segments {first.segments}: one run trains one objective (MLM + NSP "
                            "on nsp shards, MLM alone on the others); build both phases' shards the same way")
