"""RUN/logs/faults/: the fault records of every launch, attempt and node, one file each, as an agent reads them.

Every agent judges each failure its ranks meet (pretrain/launch/faults.py judge) against the records before it: the
restarts this launch spent since its checkpoint, and the attempt before (its culprit: "the same failure again").
The folder lives on the run's shared file system and grows with the job's life, requeues included (128 nodes x 50
faults: 6,400 files). So a record's file name says its launch (`TIME~JOB~HOST~PID.json`), an agent reads only its
own launch's records (and, for its first attempt, the last attempt of the launch before), each file once (kept),
and the reading runs off the agent's main thread under a time limit (READ_LIMIT_S): a file system that hangs costs
one judgement that much, with what was read before, never the agent. Records from before the launch was in the
name (`TIME-HOST-PID.json`) are read as an earlier launch's.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_prep.shard_format.atomic_io import atomic_write_bytes
from pretrain.launch.fault_records import FaultRecord

READ_LIMIT_S = 30.0  # how long one judgement waits for the folder (a hung shared file system)
SEPARATOR = "~"  # between a name's parts: never in a part (safe_part keeps [A-Za-z0-9_.-])


def safe_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def launch_of(name: str) -> str | None:
    """The launch (job) a record's file name says; None for a name from before it was said."""
    parts = name.split(SEPARATOR)
    return parts[1] if len(parts) == 4 else None


@dataclass
class FaultHistory:
    """The records of RUN/logs/faults/ (module docstring): written atomically, read once each, off the main thread."""

    folder: Path
    read_limit_s: float = READ_LIMIT_S
    read: dict[str, FaultRecord | None] = field(default_factory=dict, repr=False)  # file name -> record (None: not one)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, record: FaultRecord) -> None:
        """Write `record` atomically (a reader never sees half of it; a failed write leaves no temp file). A run
        folder that cannot take it (a full disk) costs the record, not the job: the line is printed all the same."""
        name = SEPARATOR.join((str(time.time_ns()), safe_part(record.job), safe_part(record.host), f"{os.getpid()}.json"))
        try:
            atomic_write_bytes(self.folder / name, record.to_json().encode("utf-8"))
        except OSError:
            return
        self.read[name] = record  # its own: never read back

    def records(self, job: str | None = None) -> list[FaultRecord]:
        """The records of launch `job` (None: of every launch), by time; the files not read before are read now."""
        wanted = None if job is None else safe_part(job)
        names = self._within(lambda: self._read_new(lambda name: wanted is None or launch_of(name) == wanted))
        found = [self.read.get(name) for name in names or list(self.read)]
        return sorted((r for r in found if r is not None and (job is None or r.job == job)), key=lambda r: r.time)

    def previous_attempt(self, job: str, restart: int) -> list[FaultRecord]:
        """The records of the attempt judged last before (job, restart), on any node: the one before in this launch,
        else the last of an earlier launch (only its files are read)."""
        earlier = [r for r in self.records(job) if r.restart != restart]
        if not earlier:
            earlier = self._within(lambda: self._last_launch(job)) or []
        if not earlier:
            return []
        last = earlier[-1]
        return [r for r in earlier if (r.job, r.restart) == (last.job, last.restart)]

    def spent_since(self, job: str, checkpoint: str | None, restart: int) -> int:
        """The restarts this launch spent on faults since `checkpoint` was committed: its attempts before `restart`
        whose fault restarted from that same checkpoint (None: from the start). One per attempt, however many nodes
        wrote a record of it. Progress (a newer checkpoint) starts the count again: run.max_restarts bounds the
        faults between two checkpoints, not over the job's life. An attempt that ended with a host leaving the job
        (a drop, a slow host's eviction) spends nothing: its cause left with the host."""
        records = self.records(job)
        free = {r.restart for r in records if r.drop or r.kind == "slow"}  # a host left: no fault of the run's own
        return len({r.restart for r in records if r.restart < restart and r.checkpoint == checkpoint} - free)

    def recent(self, job: str, host: str) -> list[FaultRecord]:
        """`host`'s records of launch `job` and of the launch before it (a requeue's): what the per-host fault-rate
        guard and the count of failed starts read (pretrain/launch/bad_nodes.py)."""
        before = self._within(lambda: self._last_launch(job)) or []
        return [r for r in [*before, *self.records(job)] if r.host == host]

    # ------------------------------------------------------------------ reading
    def _within(self, work: Callable[[], Any]) -> Any:
        """`work()`'s result, run in a thread of its own; None when it has not ended within the limit (it goes on,
        filling the kept records for the next judgement)."""
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
        thread.start()
        thread.join(self.read_limit_s)
        return result[0] if result else None

    def _names(self) -> list[str]:
        try:
            return sorted(name for name in os.listdir(self.folder) if name.endswith(".json"))
        except OSError:
            return []

    def _load(self, name: str) -> FaultRecord | None:
        try:
            return FaultRecord.from_json((self.folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            return None  # a record being replaced, or not ours

    def _read_new(self, wanted: Callable[[str], bool]) -> list[str]:
        """The names `wanted` picks, each read once (kept), under a lock (a judgement whose reading ran out of time
        may still be reading when the next one starts)."""
        with self._lock:
            names = [name for name in self._names() if wanted(name)]
            for name in names:
                if name not in self.read:
                    self.read[name] = self._load(name)
            return names

    def _last_launch(self, job: str) -> list[FaultRecord]:
        """The records of the launch before `job` (the newest record's that is not of `job`), for a launch that has
        none of its own yet (a requeue, a rerun); only its files are read."""
        with self._lock:
            for name in reversed(self._names()):
                if launch_of(name) == safe_part(job):
                    continue
                if name not in self.read:
                    self.read[name] = self._load(name)
                newest = self.read[name]
                if newest is not None and newest.job != job:
                    break
            else:
                return []
        launch = launch_of(name)
        records = self.records(newest.job) if launch is not None else self._legacy()
        return [r for r in records if r.job == newest.job]

    def _legacy(self) -> list[FaultRecord]:
        names = self._read_new(lambda name: launch_of(name) is None)
        return sorted((r for r in map(self.read.get, names) if r is not None), key=lambda r: r.time)
