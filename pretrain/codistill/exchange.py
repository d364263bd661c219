"""The filesystem exchange of codistillation: groups publish their weights to files and read each other's.

Layout of `exchange_dir`::

    group<g>/latest                    name of the newest complete file (rewritten atomically, last)
    group<g>/weights-step00000400.pt   {"step": global step, "flat": weights in the compute dtype}

Every file is written to a temporary name and renamed, and a file is only deleted two publications
later, so a reader never sees a half-written file and rarely loses one it was about to open (it
then re-reads `latest`).

Inside one job every group publishes the same step behind a world barrier, so the teachers are the
others' weights at exactly that step, the same as the collective exchange. Groups in separate jobs
(`codistill.group`) only meet here: a refresh takes whatever the others published last (stale by
design, as in Anil et al. 2018). Only a group's first rank touches the files; it tells the group's
other ranks what it found and sends them the weights, so every rank of a group uses the same teacher.
Waiting (for a group that has published nothing yet, or for the others' final weights at the end)
is a loop of short polls, each closed by a tiny broadcast, so no collective waits long enough to
hit the process group's timeout.

Trust. Whoever can write a group's folder can publish its weights and so steer every student that reads them.
A group folder is therefore used (written or read) only while it is a real folder owned by this user that neither
group nor others may write; the exchange root itself may be shared. A folder someone else created first, or one
others can write, is refused in one line (config error, naming codistill.exchange_dir and the folder) instead of
`mkdir(exist_ok=True)` adopting it. Published weights must be finite: a NaN or inf in a teacher would turn every
student's distillation loss into NaN, so such a file is refused naming it (data error).
"""

from __future__ import annotations

import io
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_prep.shard_format.atomic_io import atomic_write_bytes
from pretrain.errors import ConfigError, DataError

LATEST = "latest"
_KEEP_PUBLISHED = 2  # a reader may still be opening the previous file while the next is written
_NAME = re.compile(r"^weights-step(\d+)\.pt$")
POLL_SECONDS = 0.5
GROUP_FOLDER_MODE = 0o755  # never group- or world-writable, whatever the umask (which may only narrow it)


class ExchangeFolderError(ConfigError):
    """A group folder of the exchange that someone else could have written; names the key and the folder."""


class TeacherWeightsError(DataError):
    """Published weights that cannot be a teacher (not finite, or another model's); names the file or folder."""


def trusted_group_folder(folder: Path, create: bool = False) -> bool:
    """Whether `folder` exists, after checking it is ours alone: a real folder (not a link) owned by this user and
    writable by no one else. `create`: make it first (mode GROUP_FOLDER_MODE); one that already exists is checked
    like any other, never adopted. ExchangeFolderError otherwise."""
    if create:
        folder.parent.mkdir(parents=True, exist_ok=True)  # the exchange root: may be shared
        try:
            os.mkdir(folder, GROUP_FOLDER_MODE)
        except FileExistsError:
            pass
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return False
    where = f"codistill.exchange_dir: {folder}"
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ExchangeFolderError(f"{where} is not a folder but {'a link' if stat.S_ISLNK(info.st_mode) else 'a file'}"
                                  "; a group folder must be a real folder of yours")
    if info.st_uid != os.geteuid():
        raise ExchangeFolderError(f"{where} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): whoever "
                                  "created it can publish this group's weights; use an exchange_dir whose group "
                                  "folders you create")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ExchangeFolderError(f"{where} is writable by {'others' if info.st_mode & stat.S_IWOTH else 'its group'} "
                                  f"(mode {stat.S_IMODE(info.st_mode):o}): they could publish this group's weights; "
                                  f"`chmod go-w {folder}` if that is yours alone")
    return True


def publish(folder: Path, step: int, flat: torch.Tensor) -> None:
    """Write the step's weights, then switch `latest` to them, then prune (group rank 0 only)."""
    trusted_group_folder(folder, create=True)
    name = f"weights-step{step:08d}.pt"
    buffer = io.BytesIO()
    torch.save({"step": step, "flat": flat.detach().cpu()}, buffer)
    atomic_write_bytes(folder / name, buffer.getvalue())
    atomic_write_bytes(folder / LATEST, name.encode("utf-8"))
    for old in sorted(folder.glob("weights-step*.pt"))[:-_KEEP_PUBLISHED]:
        if old.name != name:
            old.unlink(missing_ok=True)


def published_step(folder: Path) -> int | None:
    """The global step of a group's newest published weights; None when it has published nothing."""
    pointer = folder / LATEST
    if not trusted_group_folder(folder) or not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"{pointer}: names {name!r}, not a weights-stepNNNNNNNN.pt file of this toolkit")
    return int(match.group(1))


def read_published(folder: Path, attempts: int = 3) -> tuple[int, torch.Tensor] | None:
    """(step, flat weights) of a group's newest file; re-reads `latest` if the file was pruned meanwhile."""
    for _ in range(attempts):
        step = published_step(folder)
        if step is None:
            return None
        path = folder / f"weights-step{step:08d}.pt"
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            continue  # a newer file replaced it between the two reads
        return int(payload["step"]), finite_weights(path, payload.get("flat"))
    raise FileNotFoundError(f"{folder}: the published weights kept disappearing while being read")


def finite_weights(path: Path, flat: Any) -> torch.Tensor:
    """`flat` if it is a floating tensor of finite values; TeacherWeightsError naming `path` otherwise."""
    if not isinstance(flat, torch.Tensor) or not flat.is_floating_point():
        raise TeacherWeightsError(f"{path}: holds no floating-point weights under 'flat' (not this toolkit's file)")
    bad = int((~torch.isfinite(flat)).sum())
    if bad:
        raise TeacherWeightsError(f"{path}: {bad} of the {flat.numel()} published weights are NaN or inf: that group "
                                  "diverged (or the file is not its own); no student learns from it")
    return flat


@dataclass
class GroupComm:
    """How a group's first rank reaches the group's other ranks."""

    size: int
    first_rank: int  # global rank of the group's rank 0 (broadcast source)
    group: Any  # process group of the group's ranks (None: the world)
    device: torch.device

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(tensor, src=self.first_rank, group=self.group)
        return tensor


class FileExchange:
    """Publish this group's weights and fetch the other groups' into their teachers."""

    def __init__(self, root: Path, group: int, others: list[int], comm: GroupComm, is_first: bool) -> None:
        self.root, self.group, self.others, self.comm, self.is_first = Path(root), group, others, comm, is_first

    def folder(self, group: int) -> Path:
        return self.root / f"group{group}"

    def publish(self, step: int, flat: torch.Tensor) -> None:
        if self.is_first:
            publish(self.folder(self.group), step, flat)

    def wait(self, at_least: dict[int, int], timeout_s: float) -> bool:
        """Until every group h in `at_least` has published step >= at_least[h], or the timeout. Same
        answer on every rank of the group."""
        deadline = time.monotonic() + timeout_s
        while True:
            verdict = torch.zeros(1, dtype=torch.int64, device=self.comm.device)  # 0 wait, 1 ready, 2 give up
            if self.is_first:
                ready = all((published_step(self.folder(h)) or -1) >= need for h, need in at_least.items())
                verdict[0] = 1 if ready else 2 if time.monotonic() >= deadline else 0
            verdict = self.comm.broadcast(verdict)
            if int(verdict.item()):
                return int(verdict.item()) == 1
            time.sleep(POLL_SECONDS)

    def fetch(self, teachers: dict[int, torch.nn.Module], load: Any) -> dict[int, int]:
        """Load each other group's newest weights into its teacher. Returns {group: step} of those found."""
        found: dict[int, int] = {}
        for other in self.others:
            teacher = teachers[other]
            param = next(teacher.parameters())
            numel = sum(p.numel() for p in teacher.parameters())
            step = torch.full((1,), -1, dtype=torch.int64, device=self.comm.device)
            flat = torch.empty(numel, dtype=param.dtype, device=param.device)
            if self.is_first:
                payload = read_published(self.folder(other))
                if payload is not None:
                    if payload[1].numel() != numel:
                        raise TeacherWeightsError(
                            f"{self.folder(other)}: {payload[1].numel()} weights published, this model has {numel} "
                            "(another architecture in codistill.exchange_dir?)"
                        )
                    step[0] = payload[0]
                    flat.copy_(payload[1].to(dtype=param.dtype))
            step = self.comm.broadcast(step)
            if int(step.item()) < 0:
                continue
            load(teacher, self.comm.broadcast(flat))
            found[other] = int(step.item())
        return found
