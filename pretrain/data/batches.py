"""Pretraining batches from data_prep shards: validation, the global data stream, collate + dynamic masking.

Parts. With `num_parts` > 1 the training instances are first dealt into `num_parts` disjoint parts
by a fixed permutation that depends only on (instance count, num_parts), never on the seed, so runs
with different seeds (codistillation groups) agree on the parts; a run then only sees its own part.

One stream, any number of ranks. Epoch e is a permutation of the run's instances (all of them, or its
part) keyed by (seed, e), computed at the positions a rank reads (pretrain/data/order.py: a Feistel
network, so no rank holds an epoch-sized array); the epochs follow each other into one endless stream of
instances, nothing dropped (a batch may straddle two epochs). Global step s trains on stream samples
[s*G, (s+1)*G), G = the global batch. The stream is cut into chunks of one micro-batch (m instances)
and chunk c goes to rank c % W as that rank's micro-batch c // W; the A accumulation steps of
W ranks therefore cover exactly the G samples of the step, for every split of G into m x A x W.
The data position saved in checkpoints is the number of samples of the phase consumed (s*G), so a
run resumes on any number of ranks at the same sample; the trainer state names the order
(`RankBatches.use_order`), and one saved before the order had a name resumes on numpy's permutation.

Masking. Unmasked (dynamic) shards are masked in collate, each instance with its own generator
`default_rng([seed, phase, epoch, instance])`: a mask depends on which instance it is and in which
epoch and phase, never on the rank, the world size or the micro-batch it lands in; no generator
state to checkpoint. Validation instances use a fixed salt instead of the seed and epoch 0. The rate of a
training micro-batch is the phase's masking schedule at the step its first sample belongs to
(pretrain/schedules/: a function of the step alone, so the same on any number of ranks and after a resume).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from data_prep.shard_format.masking import mask_ids
from data_prep.shard_format.modes import BERT_MASK_PROB
from data_prep.shard_format.shards import Manifest, ShardReader
from data_prep.shard_format.vocab import Vocab
from pretrain.data.order import FEISTEL_ORDER, InstancePool, RankOrder
from pretrain.data.packing import pack_masked_instances
from pretrain.data.shard_checks import PhaseShards, check_phase_shards
from pretrain.data.stream_sections import PackingSection, PartSection
from pretrain.data.unpadded import unpad_masked_instances
from pretrain.errors import ConfigError, DataError
from pretrain.keys import SeedSection
from pretrain.model.bert import IGNORE_INDEX
from pretrain.schedules.phase import PhaseSchedules

VAL_SEED_SALT = 0x5EED_7A1  # validation masks: fixed, independent of the training seed's epochs
UNCHECKED = "; data.verify_checksums=true names its shard and row before training"


class DataConfigError(DataError):
    """The shards do not fit the run (missing, wrong vocab, wrong length); names the key or file. (Rank 0's
    start-up checks report it as the config error of the key that names the shards, as the launch check does.)"""


@dataclass(frozen=True)
class PhaseData:
    """The validated shards of one phase."""

    manifest: Manifest
    vocab: Vocab
    seq_len: int
    max_predictions: int
    mask_prob: float
    whole_word: bool

    @property
    def trains_nsp(self) -> bool:
        """Sentence-pair shards (data_prep --segments nsp) train MLM + NSP; packed ones MLM alone."""
        return self.manifest.next_sentence_labels


def open_phase_data(
    shards: str | Path,
    seq_len: int,
    max_predictions: int | None,
    key: str,
    expected_vocab_sha256: str | None = None,
    verify_checksums: bool = True,
) -> PhaseData:
    """Load and check a shard folder for a phase before any engine exists. `key` names the config entry.

    The checks are the launch-time check's (pretrain/data/shard_checks.py), plus the shards' checksums."""
    try:
        checked = check_phase_shards(shards, seq_len, max_predictions, key, expected_vocab_sha256, verify_checksums)
    except ConfigError as err:
        raise DataConfigError(str(err)) from err
    return phase_data(checked, seq_len)


def phase_data(checked: PhaseShards, seq_len: int) -> PhaseData:
    """The data of a phase whose shards passed `check_phase_shards` (the run's plan checks them once)."""
    masking = checked.manifest.data["masking"]
    return PhaseData(
        manifest=checked.manifest,
        vocab=checked.vocab,
        seq_len=seq_len,
        max_predictions=checked.max_predictions,
        mask_prob=checked.mask_prob,
        whole_word=bool(masking.get("whole_word", False)),
    )


Generators = np.random.Generator | list[np.random.Generator] | None  # one for the batch, or one per instance


class Collator:
    """Instances -> padded tensors (one instance per row), or packed rows when `packing` (see
    pretrain/data/packing.py). Masking draws from `rng` in instance order (or from one generator per
    instance when given a list) either way, so both layouts of the same instances carry the same
    masks. Picklable, so DataLoader workers can run it."""

    def __init__(self, data: PhaseData, packing: bool = False, unpadded: bool = False) -> None:
        self.data = data
        self.packing = packing
        self.unpadded = unpadded  # flat real tokens (pretrain/data/unpadded.py); beats packing

    def masked_instances(self, rows: list[dict[str, Any]], rng: Generators,
                         mask_prob: float | None = None) -> list[dict[str, Any]]:
        """(ids with masks applied, a_len, masked positions, original ids there, nsp label) per instance; dynamic
        shards are masked at `mask_prob` (None: the phase's rate, data.mask_prob)."""
        seq_len, predictions = self.data.seq_len, self.data.max_predictions
        rate = self.data.mask_prob if mask_prob is None else mask_prob
        out = []
        for index, row in enumerate(rows):
            ids = row["input_ids"]
            if len(ids) > seq_len:
                raise DataConfigError(f"an instance has {len(ids)} tokens, more than the phase's seq_len {seq_len}")
            self.check_values(ids, "token id")
            if "masked_positions" in row:
                ids, pos, lab = ids, row["masked_positions"], row["masked_label_ids"]
                self.check_values(lab, "masked label id")
                if len(pos) and int(pos.max()) >= len(ids):
                    raise DataConfigError(f"masked position {int(pos.max())} lies outside its instance of {len(ids)} "
                                          f"tokens in {self.data.manifest.root}{UNCHECKED}")
            else:
                assert rng is not None, "dynamic masking needs a generator"
                own = rng[index] if isinstance(rng, list | tuple) else rng
                ids, pos, lab = mask_ids(ids, self.data.vocab, rate, predictions, self.data.whole_word, own)
            out.append({"ids": ids, "a_len": row["a_len"], "positions": pos, "labels": lab,
                        "nsp": row["next_sentence_label"]})
        return out

    def check_values(self, ids: np.ndarray, what: str) -> None:
        """The last guard against an id outside the vocab (an IndexError in the forward pass; on a GPU a
        device-side assert), for shards whose values rank 0 did not check (data.verify_checksums=false)."""
        size = self.data.vocab.size
        if len(ids) and (int(ids.max()) >= size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= size else int(ids.min())
            raise DataConfigError(f"{what} {bad} is outside the vocab (ids 0 to {size - 1}) in "
                                  f"{self.data.manifest.root}{UNCHECKED}")

    def __call__(self, rows: list[dict[str, Any]], rng: Generators,
                 mask_prob: float | None = None) -> dict[str, torch.Tensor]:
        instances = self.masked_instances(rows, rng, mask_prob)
        seq_len, predictions = self.data.seq_len, self.data.max_predictions
        if self.unpadded:
            return unpad_masked_instances(instances, seq_len, predictions, self.data.vocab.pad_id)
        if self.packing:
            return pack_masked_instances(instances, seq_len, predictions, self.data.vocab.pad_id)
        return pad_masked_instances(instances, seq_len, predictions, self.data.vocab.pad_id)


def pad_masked_instances(instances: list[dict[str, Any]], seq_len: int, max_predictions: int,
                         pad_id: int) -> dict[str, torch.Tensor]:
    """Already-masked instances (ids, a_len, positions, labels, nsp) -> padded rows of seq_len, one per instance:
    the padded layout (packed: pretrain/data/packing.py, unpadded: pretrain/data/unpadded.py)."""
    batch = len(instances)
    input_ids = np.full((batch, seq_len), pad_id, dtype=np.int64)
    token_types = np.zeros((batch, seq_len), dtype=np.int64)
    attention = np.zeros((batch, seq_len), dtype=np.int64)
    positions = np.zeros((batch, max_predictions), dtype=np.int64)
    labels = np.full((batch, max_predictions), IGNORE_INDEX, dtype=np.int64)
    nsp = np.zeros(batch, dtype=np.int64)
    for i, inst in enumerate(instances):
        ids, pos, lab = inst["ids"], inst["positions"], inst["labels"]
        n = len(ids)
        input_ids[i, :n] = ids
        token_types[i, inst["a_len"] : n] = 1
        attention[i, :n] = 1
        positions[i, : len(pos)] = pos[:max_predictions]
        labels[i, : len(lab)] = lab[:max_predictions]
        nsp[i] = inst["nsp"]
    return {
        "input_ids": torch.from_numpy(input_ids),
        "token_type_ids": torch.from_numpy(token_types),
        "attention_mask": torch.from_numpy(attention),
        "masked_positions": torch.from_numpy(positions),
        "masked_labels": torch.from_numpy(labels),
        "next_sentence_label": torch.from_numpy(nsp),
    }


@dataclass(frozen=True)
class StreamPlan:
    """How a phase's instances become this rank's micro-batches, besides the data and the job's shape: built by
    the run plan (pretrain/plan/run_plan.py) from the config's sections the stream reads (run.seed, data.part /
    data.num_parts, phaseN.packing: declared in pretrain/keys.py and pretrain/data/stream_sections.py), the
    attention path (unpadded: the flat layout of pretrain/data/unpadded.py) and the phase's schedules (the masking
    rate of each step; None: the phase's one rate)."""

    run: SeedSection = field(default_factory=SeedSection)  # run.seed: the order and the dynamic masks
    parts: PartSection = field(default_factory=PartSection)  # data.part of data.num_parts
    layout: PackingSection = field(default_factory=PackingSection)  # phaseN.packing
    unpadded: bool = False
    schedules: PhaseSchedules | None = None

    def batches(self, data: PhaseData, split: str, rank: int, world_size: int, micro_batch: int) -> RankBatches:
        """This rank's stream of `split` ("train": shuffled, this run's part; "val": in order, every instance).

        Validation masks dynamic shards at BERT's 15 % whatever data.mask_probability trains with (as MosaicBERT
        evaluated its 30 % runs), so val/mlm_acc compares across recipes and with the quality marks."""
        if split == "train":
            return RankBatches(data, split, self.run.seed, rank, world_size, micro_batch, packing=self.layout.packing,
                               part=self.parts.part, num_parts=self.parts.num_parts, unpadded=self.unpadded,
                               schedules=self.schedules)
        if not data.manifest.static_masking:  # held-out numbers at BERT's rate, whatever the training rate
            data = dataclasses.replace(data, mask_prob=BERT_MASK_PROB)
        return RankBatches(data, split, self.run.seed, rank, world_size, micro_batch, shuffle=False,
                           unpadded=self.unpadded)


class RankBatches(Dataset):
    """Item k = this rank's k-th micro-batch: chunk k * world_size + rank of the endless global stream. Which
    instances a chunk holds is `order`'s (pretrain/data/order.py RankOrder), computed per item: no state
    between items, nothing epoch-sized held."""

    def __init__(
        self, data: PhaseData, split: str, seed: int, rank: int, world_size: int, micro_batch: int,
        shuffle: bool = True, packing: bool = False, part: int = 0, num_parts: int = 1, phase_index: int = 0,
        unpadded: bool = False, order: str = FEISTEL_ORDER, schedules: PhaseSchedules | None = None,
    ) -> None:
        self.data = data
        self.schedules = schedules  # the masking rate per step (None: data.mask_prob throughout)
        self.reader = ShardReader(data.manifest, data.seq_len, split)
        self.collate = Collator(data, packing=packing, unpadded=unpadded)  # layouts differ, never the instances
        self.seed, self.rank, self.world_size, self.micro_batch = seed, rank, world_size, micro_batch
        self.shuffle = shuffle
        self.phase_index = phase_index  # part of every mask's seed; the trainer sets it for its phase
        self.order = RankOrder(len(self.reader), seed, rank, world_size, micro_batch, shuffle, part, num_parts, order)
        self.batches_per_epoch = len(self.pool) // world_size // micro_batch  # whole chunks per rank and epoch
        if self.batches_per_epoch == 0:
            where = f" in data.part {part} of {num_parts}" if num_parts > 1 else ""
            raise DataConfigError(
                f"{data.manifest.root}: {len(self.pool)} {split} instances at seq {data.seq_len}{where} cannot fill "
                f"one micro-batch of {micro_batch} on each of {world_size} ranks"
            )

    def __len__(self) -> int:
        return self.batches_per_epoch

    @property
    def pool(self) -> InstancePool:
        """The instances this run reads (all, or its part): pool position -> instance index."""
        return self.order.pool

    def use_order(self, name: str) -> None:
        """Read the stream in the order `name` (pretrain/data/order.py ORDERS). The trainer sets the one its phase
        state records, so a run resumes on the order it started with."""
        self.order = dataclasses.replace(self.order, name=name)

    def epoch_end(self, k: int) -> int:
        """The first micro-batch after `k` whose first sample lies in a later epoch than `k`'s first sample."""
        return self.order.epoch_end(k)

    def prepare(self, first: int, end: int) -> None:
        """Compute, in this process, what micro-batches first .. end-1 need ahead (the legacy order's epoch slices)."""
        self.order.prepare(first, end)

    def rank_indices(self, epoch: int) -> np.ndarray:
        """This rank's instance indices of `epoch`, in stream order (its own copy)."""
        return self.order.rank_indices(epoch)

    def stream_instances(self, first: int, count: int) -> list[tuple[int, int]]:
        """(epoch, instance index) of stream samples first .. first+count-1 (they must be this rank's)."""
        epochs, instances = self.order.samples(first, count)
        return list(zip(epochs.tolist(), instances.tolist(), strict=True))

    def collate_instances(self, picked: list[tuple[int, int]], mask_prob: float | None = None) -> dict[str, torch.Tensor]:
        """Read and collate (epoch, instance) pairs, each masked by its own generator at `mask_prob` (None: the
        phase's rate)."""
        salt = self.seed if self.shuffle else VAL_SEED_SALT
        rows = [self.reader[instance] for _, instance in picked]
        rngs = [np.random.default_rng([salt, self.phase_index, epoch, instance]) for epoch, instance in picked]
        return self.collate(rows, rngs, mask_prob)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        first = (int(k) * self.world_size + self.rank) * self.micro_batch  # the micro-batch's first stream sample
        rate = None if self.schedules is None else self.schedules.mask_rate_at_sample(first)
        return self.collate_instances(self.stream_instances(first, self.micro_batch), rate)


class ValidationBatches:
    """This rank's share of the first `instances` held-out instances, as micro-batches.

    The held-out set is read in file order and cut into chunks of one micro-batch, dealt round robin
    to the ranks; which instances are evaluated and their masks do not depend on the world size. Every
    rank runs the same number of forward passes (ZeRO-3 gathers parameters in each one): a rank whose
    chunks ran out evaluates its first chunk again with every label ignored, which adds nothing.
    """

    def __init__(self, batches: RankBatches, instances: int) -> None:
        self.batches = batches
        self.total = min(int(instances), len(batches.pool))
        micro, world = batches.micro_batch, batches.world_size
        chunks = [(start, min(micro, self.total - start)) for start in range(0, self.total, micro)]
        self.mine = chunks[batches.rank :: world]
        self.count = -(-len(chunks) // world)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.count):
            blank = i >= len(self.mine)
            start, size = self.mine[0 if blank else i] if self.mine else (0, 1)
            positions = range(start, start + size)
            batch = self.batches.collate_instances([(0, int(self.batches.pool[p])) for p in positions])
            if blank or not self.mine:
                batch["masked_labels"] = torch.full_like(batch["masked_labels"], IGNORE_INDEX)
            yield batch
