"""Pretraining batches from data_prep shards: validation, per-rank order, collate + dynamic masking.

Parts. With `num_parts` > 1 the training instances are first dealt into `num_parts` disjoint parts
by a fixed permutation that depends only on (instance count, num_parts), never on the seed, so runs
with different seeds (codistillation groups) agree on the parts; a run then only sees its own part.

Order. Epoch e is a permutation of the run's instances (all of them, or its part) drawn from
`default_rng([seed, e])`, the same on every rank; rank r takes every world_size-th instance of it
(disjoint across ranks), the tail that does not fill a micro-batch on every rank is dropped for that
epoch (it comes back in another position next epoch). A rank's stream is therefore a pure function of (seed, world size,
rank, micro batch): micro-batch k of the stream is epoch k // batches_per_epoch. The data position
saved in checkpoints is just k, and resuming means starting the sampler at k.

Masking. Unmasked (dynamic) shards are masked in collate with `default_rng([seed, epoch, rank,
batch_in_epoch])`: different masks each epoch and rank, and no generator state to checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from data_prep.shards import Manifest, ShardFormatError, ShardReader, sha256_file
from pretrain.model import IGNORE_INDEX
from pretrain.packing import pack_masked_instances

VAL_SEED_SALT = 0x5EED_7A1  # validation masks: fixed, independent of the training seed's epochs
PARTITION_SALT = 0xD15_70177  # the deal into disjoint parts: fixed, independent of every seed


def partition_indices(total: int, part: int, num_parts: int) -> np.ndarray:
    """Instance indices of part `part` of `num_parts` disjoint parts (sizes differ by at most one)."""
    if num_parts < 1 or not 0 <= part < num_parts:
        raise ValueError(f"data.part: {part} is not a part of {num_parts}")
    if num_parts == 1:
        return np.arange(total)
    deal = np.random.default_rng([PARTITION_SALT, total, num_parts]).permutation(total)
    return np.sort(deal[part::num_parts])


class DataConfigError(ValueError):
    """The shards do not fit the run (missing, wrong vocab, wrong length); names the key or file."""


@dataclass(frozen=True)
class Vocab:
    size: int
    sha256: str
    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    is_continuation: np.ndarray  # bool[size]: WordPiece "##" pieces, for whole-word masking

    @classmethod
    def load(cls, path: Path) -> Vocab:
        tokens = path.read_text(encoding="utf-8").splitlines()
        index = {token: i for i, token in enumerate(tokens)}
        missing = [t for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]") if t not in index]
        if missing:
            raise DataConfigError(f"{path}: vocab lacks the special tokens {missing}")
        return cls(
            size=len(tokens),
            sha256=sha256_file(path),
            cls_id=index["[CLS]"],
            sep_id=index["[SEP]"],
            mask_id=index["[MASK]"],
            pad_id=index["[PAD]"],
            is_continuation=np.array([t.startswith("##") for t in tokens], dtype=bool),
        )


@dataclass(frozen=True)
class PhaseData:
    """The validated shards of one phase."""

    manifest: Manifest
    vocab: Vocab
    seq_len: int
    max_predictions: int
    mask_prob: float
    whole_word: bool


def open_phase_data(
    shards: str | Path,
    seq_len: int,
    max_predictions: int | None,
    key: str,
    expected_vocab_sha256: str | None = None,
    verify_checksums: bool = True,
) -> PhaseData:
    """Load and check a shard folder for a phase before any engine exists. `key` names the config entry."""
    try:
        manifest = Manifest.load(shards)
    except ShardFormatError as err:
        raise DataConfigError(f"{key}: {err}") from err
    if seq_len not in manifest.seq_lens:
        raise DataConfigError(
            f"{key}: {manifest.root} has no shards at sequence length {seq_len} (it has {manifest.seq_lens})"
        )
    try:
        manifest.verify(seq_len, "train", checksums=verify_checksums)
    except ShardFormatError as err:
        raise DataConfigError(f"{key}: {err}") from err
    if not manifest.vocab_path.is_file():
        raise DataConfigError(f"{key}: vocab file {manifest.vocab_path} is missing")
    vocab = Vocab.load(manifest.vocab_path)
    if vocab.sha256 != manifest.vocab_sha256 or vocab.size != manifest.vocab_size:
        raise DataConfigError(
            f"{key}: {manifest.vocab_path} (size {vocab.size}, sha256 {vocab.sha256[:12]}) differs from the "
            f"manifest's vocab (size {manifest.vocab_size}, sha256 {manifest.vocab_sha256[:12]})"
        )
    if expected_vocab_sha256 is not None and vocab.sha256 != expected_vocab_sha256:
        raise DataConfigError(
            f"{key}: vocab sha256 {vocab.sha256[:12]} differs from the model's vocab {expected_vocab_sha256[:12]}"
        )
    masking = manifest.data["masking"]
    from_manifest = masking.get("max_predictions", {}).get(str(seq_len))
    predictions = max_predictions if max_predictions is not None else from_manifest
    if predictions is None:
        raise DataConfigError(f"{key}: the manifest has no masking.max_predictions for {seq_len}; set max_predictions")
    if manifest.static_masking and from_manifest is not None and predictions < from_manifest:
        raise DataConfigError(
            f"max_predictions: {predictions} is below the static shards' {from_manifest} at seq {seq_len}"
        )
    return PhaseData(
        manifest=manifest,
        vocab=vocab,
        seq_len=seq_len,
        max_predictions=int(predictions),
        mask_prob=float(masking.get("mask_prob", 0.15)),
        whole_word=bool(masking.get("whole_word", False)),
    )


def mask_instance(
    ids: np.ndarray, vocab: Vocab, mask_prob: float, max_predictions: int, whole_word: bool, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BERT masking of one instance: returns (masked ids, positions, original ids). 80/10/10 mask/random/keep."""
    candidates = np.flatnonzero((ids != vocab.cls_id) & (ids != vocab.sep_id))
    target = min(max_predictions, max(1, int(round(len(ids) * mask_prob))))
    if whole_word and len(candidates):
        # A word = a piece not starting with "##" plus the "##" pieces after it: masked together.
        starts = ~vocab.is_continuation[ids[candidates]] | (np.diff(candidates, prepend=-2) != 1)
        words = np.split(candidates, np.flatnonzero(starts)[1:])
        chosen: list[int] = []
        for w in rng.permutation(len(words)):
            if len(chosen) + len(words[w]) > target:
                continue
            chosen.extend(words[w].tolist())
        positions = np.sort(np.array(chosen, dtype=np.int64))
    else:
        positions = np.sort(rng.permutation(candidates)[:target])
    labels = ids[positions].copy()
    masked = ids.copy()
    roll = rng.random(len(positions))
    random_ids = rng.integers(0, vocab.size, len(positions))
    masked[positions] = np.where(roll < 0.8, vocab.mask_id, np.where(roll < 0.9, random_ids, labels))
    return masked, positions, labels


class Collator:
    """Instances -> padded tensors (one instance per row), or packed rows when `packing` (see
    pretrain/packing.py). Masking draws from `rng` in instance order either way, so both layouts of
    the same instances carry the same masks. Picklable, so DataLoader workers can run it."""

    def __init__(self, data: PhaseData, packing: bool = False) -> None:
        self.data = data
        self.packing = packing

    def masked_instances(self, rows: list[dict[str, Any]], rng: np.random.Generator | None) -> list[dict[str, Any]]:
        """(ids with masks applied, a_len, masked positions, original ids there, nsp label) per instance."""
        seq_len, predictions = self.data.seq_len, self.data.max_predictions
        out = []
        for row in rows:
            ids = row["input_ids"]
            if len(ids) > seq_len:
                raise DataConfigError(f"an instance has {len(ids)} tokens, more than the phase's seq_len {seq_len}")
            if "masked_positions" in row:
                ids, pos, lab = ids, row["masked_positions"], row["masked_label_ids"]
            else:
                assert rng is not None, "dynamic masking needs a generator"
                ids, pos, lab = mask_instance(
                    ids, self.data.vocab, self.data.mask_prob, predictions, self.data.whole_word, rng
                )
            out.append({"ids": ids, "a_len": row["a_len"], "positions": pos, "labels": lab,
                        "nsp": row["next_sentence_label"]})
        return out

    def __call__(self, rows: list[dict[str, Any]], rng: np.random.Generator | None) -> dict[str, torch.Tensor]:
        instances = self.masked_instances(rows, rng)
        seq_len, predictions = self.data.seq_len, self.data.max_predictions
        if self.packing:
            return pack_masked_instances(instances, seq_len, predictions, self.data.vocab.pad_id)
        batch = len(rows)
        input_ids = np.full((batch, seq_len), self.data.vocab.pad_id, dtype=np.int64)
        token_types = np.zeros((batch, seq_len), dtype=np.int64)
        attention = np.zeros((batch, seq_len), dtype=np.int64)
        positions = np.zeros((batch, predictions), dtype=np.int64)
        labels = np.full((batch, predictions), IGNORE_INDEX, dtype=np.int64)
        nsp = np.zeros(batch, dtype=np.int64)
        for i, inst in enumerate(instances):
            ids, pos, lab = inst["ids"], inst["positions"], inst["labels"]
            n = len(ids)
            input_ids[i, :n] = ids
            token_types[i, inst["a_len"] : n] = 1
            attention[i, :n] = 1
            positions[i, : len(pos)] = pos[:predictions]
            labels[i, : len(lab)] = lab[:predictions]
            nsp[i] = inst["nsp"]
        return {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_types),
            "attention_mask": torch.from_numpy(attention),
            "masked_positions": torch.from_numpy(positions),
            "masked_labels": torch.from_numpy(labels),
            "next_sentence_label": torch.from_numpy(nsp),
        }


class RankBatches(Dataset):
    """Item k = this rank's k-th micro-batch of the endless, epoch-reshuffled stream."""

    def __init__(
        self, data: PhaseData, split: str, seed: int, rank: int, world_size: int, micro_batch: int,
        shuffle: bool = True, packing: bool = False, part: int = 0, num_parts: int = 1,
    ) -> None:
        self.data = data
        self.reader = ShardReader(data.manifest, data.seq_len, split)
        self.collate = Collator(data, packing=packing)  # packing changes the layout, never the instances
        self.seed, self.rank, self.world_size, self.micro_batch = seed, rank, world_size, micro_batch
        self.shuffle = shuffle
        self.pool = partition_indices(len(self.reader), part, num_parts)  # the instances this run reads
        self.batches_per_epoch = len(self.pool) // world_size // micro_batch
        if self.batches_per_epoch == 0:
            where = f" in data.part {part} of {num_parts}" if num_parts > 1 else ""
            raise DataConfigError(
                f"{data.manifest.root}: {len(self.pool)} {split} instances at seq {data.seq_len}{where} cannot fill "
                f"one micro-batch of {micro_batch} on each of {world_size} ranks"
            )
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def rank_indices(self, epoch: int) -> np.ndarray:
        """This rank's instance indices of `epoch`, in order (cached for the current epoch).

        The cache is a copy of this rank's slice: a strided view would keep the whole epoch permutation
        (world_size times larger) alive in the dataset, i.e. in every DataLoader worker.
        """
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            total = len(self.pool)
            picks = np.random.default_rng([self.seed, epoch]).permutation(total) if self.shuffle else np.arange(total)
            order = self.pool[picks]  # with one part the pool is 0..n-1: the order is the permutation itself
            used = self.batches_per_epoch * self.micro_batch * self.world_size
            self._epoch_order = (epoch, order[:used][self.rank :: self.world_size].copy())
        return self._epoch_order[1]

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        epoch, within = divmod(int(k), self.batches_per_epoch)
        indices = self.rank_indices(epoch)[within * self.micro_batch : (within + 1) * self.micro_batch]
        rows = [self.reader[int(i)] for i in indices]
        salt = self.seed if self.shuffle else VAL_SEED_SALT
        rng = np.random.default_rng([salt, epoch, self.rank, within])
        return self.collate(rows, rng)


class StreamSampler(Sampler[int]):
    """k, k+1, ... forever (or `count` items): the resumable position is the first k."""

    def __init__(self, start: int, count: int | None = None) -> None:
        self.start, self.count = start, count

    def __iter__(self) -> Iterator[int]:
        k = self.start
        while self.count is None or k < self.start + self.count:
            yield k
            k += 1


def batch_loader(batches: RankBatches, start: int, num_workers: int, count: int | None = None) -> DataLoader:
    """A DataLoader over micro-batches start, start+1, ...; workers only change speed, never content."""
    return DataLoader(
        batches,
        batch_size=None,
        sampler=StreamSampler(start, count),
        num_workers=num_workers,
        persistent_workers=False,
        prefetch_factor=4 if num_workers else None,
        pin_memory=torch.cuda.is_available(),
        multiprocessing_context="fork" if num_workers and os.name == "posix" else None,
    )
