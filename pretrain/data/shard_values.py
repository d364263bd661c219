"""Does a shard hold what its schema promises? Its bytes (sha256, as the manifest lists it) and its values: every
token id below the vocab size, every instance within the sequence length, every static masked position inside
its own instance, every label id below the vocab size and every next-sentence label one the format defines.

Why values too: a shard whose checksum was recorded after a bad write (a hand-made or converted shard, a build
with another vocab) passes the byte check, and then an id >= the vocab size crashes the forward pass at whichever
step draws it (on a GPU a device-side assert, at the same step again after every restart), while a static masked
position beyond its instance's length labels a token of the next instance in the unpadded layout, silently.

One read per shard: the file is memory-mapped once, hashed from that mapping, and its columns checked in place by
pyarrow.compute (flatten the list values, one min/max pass each; each row's largest masked position against its
length in one numpy pass); only a shard found wrong is searched again for
the first offending row. Rank 0 does it at start-up with the checksums (pretrain/data/shard_checks.py).

Light: the standard library and pyarrow on plain values (a path, a digest, the limits); no torch, nothing of ours.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

HASH_CHUNK = 1 << 20
NSP_LABELS = (0, 1, -1)  # is next, random next, none (packed modes): the values data_prep/shard_format/shards.py defines


class ShardValueError(ValueError):
    """A shard's bytes or values are not what the manifest and the phase promise; names the file (and row)."""


@dataclass(frozen=True)
class ValueLimits:
    """What every value of a phase's shards must stay below."""

    vocab_size: int  # token and label ids: 0 <= id < vocab_size
    seq_len: int  # tokens of one instance


def check_shard(path: Path, sha256: str | None, limits: ValueLimits) -> None:
    """ShardValueError in one line naming the file (and for a value, its row and the value) when the shard's
    sha256 differs from `sha256` (the manifest's; None: not hashed) or a value lies outside `limits`."""
    if not path.is_file():
        raise ShardValueError(f"{path}: listed in the manifest but missing")
    try:
        buffer = pa.memory_map(str(path), "r").read_buffer()
    except (OSError, pa.ArrowInvalid) as err:
        raise ShardValueError(f"{path}: not a readable shard file: {err}") from err
    if sha256 is not None and _sha256(buffer) != sha256:
        raise ShardValueError(f"{path}: sha256 differs from the manifest (corrupt or replaced)")
    try:
        table = ipc.open_file(buffer).read_all()
    except (OSError, pa.ArrowInvalid) as err:
        raise ShardValueError(f"{path}: not a readable Arrow IPC shard: {err}") from err
    problem = _schema_problem(table.schema) or first_bad_value(table, limits)
    if problem is not None:
        raise ShardValueError(f"{path}: {problem}; rebuild the shards (python -m data_prep build)")


def _sha256(buffer: pa.Buffer) -> str:
    digest, view = hashlib.sha256(), memoryview(buffer)
    for start in range(0, len(view), HASH_CHUNK):
        digest.update(view[start : start + HASH_CHUNK])
    return digest.hexdigest()


def _schema_problem(schema: pa.Schema) -> str | None:
    """What the columns the check reads lack: lists of integer ids, the static pair together."""
    static = {"masked_positions", "masked_label_ids"} & set(schema.names)
    for name in ("input_ids", *sorted(static)):
        kind = schema.field(name).type if name in schema.names else None
        if kind is None or not pa.types.is_list(kind) or not pa.types.is_integer(kind.value_type):
            return f"column {name} is {kind or 'missing'}, not a list of integer ids (not a shard of this format)"
    if len(static) == 1:
        return f"column {static.pop()} without its pair (masked_positions and masked_label_ids go together)"
    return None


def first_bad_value(table: pa.Table, limits: ValueLimits) -> str | None:
    """The first value of `table` outside `limits`, as "row R: what" (R counted from 0 in the file); None if all fit."""
    row0 = 0
    for batch in table.to_batches():
        problem = _batch_problem(batch, limits)
        if problem is not None:
            row, what = problem
            return f"row {row0 + row}: {what}"
        row0 += batch.num_rows
    return None


def _batch_problem(batch: pa.RecordBatch, limits: ValueLimits) -> tuple[int, str] | None:
    ids = batch.column("input_ids")
    lengths = pc.list_value_length(ids)
    if batch.num_rows and pc.max(lengths).as_py() > limits.seq_len:
        row = _first_true(pc.greater(lengths, limits.seq_len))
        return row, f"an instance of {lengths[row].as_py()} tokens, more than the sequence length {limits.seq_len}"
    found = _id_problem(ids, "token id", limits.vocab_size) or _label_problem(batch.column("next_sentence_label"))
    if found is not None or "masked_positions" not in batch.schema.names:
        return found
    positions, labels = batch.column("masked_positions"), batch.column("masked_label_ids")
    if not pc.all(pc.equal(pc.list_value_length(positions), pc.list_value_length(labels))).as_py():
        row = _first_true(pc.not_equal(pc.list_value_length(positions), pc.list_value_length(labels)))
        return row, (f"{len(positions[row])} masked positions but {len(labels[row])} masked label ids")
    found = _id_problem(labels, "masked label id", limits.vocab_size)
    if found is not None:
        return found
    return _position_problem(positions, lengths)


def _position_problem(positions: pa.ListArray, lengths: pa.Array) -> tuple[int, str] | None:
    """The first row with a masked position outside its own instance. Each row's largest position against its
    length: one numpy pass over the positions (a per-value compare against each value's row length cost four)."""
    offsets = positions.offsets.to_numpy()
    flat = pc.list_flatten(positions).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(np.diff(offsets) > 0)  # rows with positions: their segments tile `flat`
    if len(rows) == 0:
        return None
    highest = np.maximum.reduceat(flat, offsets[rows] - offsets[0])
    own = lengths.to_numpy(zero_copy_only=False)[rows]
    outside = np.flatnonzero(highest >= own)
    if len(outside) == 0:
        return None
    row = int(rows[outside[0]])
    return row, (f"masked position {int(highest[outside[0]])} outside its instance of {int(own[outside[0]])} "
                 "tokens (it would label another instance's token)")


def _id_problem(column: pa.Array, what: str, vocab_size: int) -> tuple[int, str] | None:
    """The first id of a list column outside 0 .. vocab_size-1, as (row, words)."""
    flat = pc.list_flatten(column)
    if len(flat) == 0:
        return None
    low, high = pc.min_max(flat).values()
    if low.as_py() >= 0 and high.as_py() < vocab_size:
        return None
    at = _first_true(pc.or_(pc.greater_equal(flat, vocab_size), pc.less(flat, 0)))
    row = pc.list_parent_indices(column)[at].as_py()
    return row, f"{what} {flat[at].as_py()} outside the vocab (ids 0 to {vocab_size - 1})"


def _label_problem(labels: pa.Array) -> tuple[int, str] | None:
    """The first next-sentence label the format does not define (data_prep/shard_format/shards.py: 0, 1, or -1 for none): on a GPU
    another value is a device-side assert in the NSP loss at whichever step draws it, after every restart."""
    bad = pc.invert(pc.is_in(labels, value_set=pa.array(NSP_LABELS, type=labels.type)))
    if not pc.any(bad).as_py():
        return None
    row = _first_true(bad)
    return row, f"next_sentence_label {labels[row].as_py()} (the format's are {', '.join(map(str, NSP_LABELS))})"


def _first_true(mask: pa.Array) -> int:
    return pc.index(mask, True).as_py()
