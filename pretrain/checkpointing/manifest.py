"""What a checkpoint holds (files, sizes, sha256), written with it and checked before a resume.

Writing: each rank hashes the files it wrote itself, right after writing them (they are still in the
page cache, and the ranks hash in parallel): files named for a rank (`zero_pp_rank_R_*`,
`rng_rankR.pt`, `elastic_layout_rankR.json`) belong to rank R, every other file to rank 0, which
writes them (model states, trainer state, run config, PHASE_END, ...). One all-gather brings the
entries to rank 0, which writes `MANIFEST.json` atomically before `latest` may name the tag.

Resuming: rank 0 of each model checks the newest checkpoint against its manifest (every file there,
same size, same sha256). A damaged one is reported in one line naming the file, moved aside to
`<tag>.damaged`, and the newest intact older checkpoint that keep-last-k kept is used instead; the
`latest` pointer is switched to it. The verdict travels with one all-gather, so every rank resumes
from the same tag, and codistillation groups of one job agree on the newest tag intact in all of
them. Without any intact checkpoint the run stops with one line listing what was wrong with each.
The manifest is the tag's commit marker, written last (pretrain/checkpointing/commit.py): an older tag
without one is a save that did not finish and never a fallback. The tag `latest` names without a manifest
was written before manifests existed and is resumed unverified.

Nothing committed is deleted at resume, whatever `latest` says (`read_latest` checks it):
- only tag folders WITHOUT a manifest that are newer than the bound are deleted, in one line: the bound is
  the tag `latest` names, or, with `latest` missing, empty or unreadable, the newest committed tag;
- a committed tag newer than `latest` (the pointer's rewrite was lost: a crash between the manifest and
  `latest`, or an older `latest` copied back) is kept and is the first candidate, said in one line;
- with no usable `latest` the newest committed tag that verifies is resumed, said in one line, and `latest`
  is rewritten to it; a `latest` that names no tag folder of this checkpoint folder is refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from data_prep.shard_format.atomic_io import atomic_write_bytes, atomic_write_json, fsync_folder, sha256_file
from pretrain.checkpointing.layout import (
    CONSOLIDATED,
    LATEST,
    MANIFEST,
    PRUNED_PREFIX,
    TAG_PATTERN,
    tag_order,
)
from pretrain.distributed.json_collectives import all_gather_json
from pretrain.errors import ResumeError

__all__ = ["MANIFEST", "PointerError", "damage", "file_owner", "gather_entries", "manifest_bytes", "read_latest",
           "resolve_resume_tag", "write_manifest"]

_RANK_FILE = re.compile(r"^(?:[a-z0-9]+_)?(?:zero_pp_rank_|rng_rank|elastic_layout_rank)(\d+)[_.]")
_UNLISTED = (CONSOLIDATED, MANIFEST)  # written after the manifest (conversion), or the manifest itself


# ---------------------------------------------------------------------- latest
_MOST_BYTES = 4096  # a tag name is ~20 bytes: never read a huge or endless file whole


class PointerError(ResumeError):
    """`latest` names something that is no tag folder of its checkpoint folder (the message names both).

    `latest` is one small file that a person, a copy (`cp -r phase*`), a sync tool or a purge can remove, empty or
    rewrite: missing, empty or unreadable it is no pointer (`Pointer.problem`, and resume looks at the tags
    themselves); a value that is no tag name (no absolute path, no `..`, no separator) or names a symbolic link
    is refused, never a reason to load or delete anything."""


@dataclass(frozen=True)
class Pointer:
    """`latest` as read: the tag it names, or (tag None) why there is none: "missing", "empty", "unreadable (...)"."""

    tag: str | None
    problem: str | None = None


def read_latest(root: Path) -> Pointer:
    """`root`/latest, checked (see the module docstring). Raises PointerError for a value that is no tag here."""
    path = Path(root) / LATEST
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO or a link is no pointer of ours
        try:
            raw = os.read(fd, _MOST_BYTES)
        finally:
            os.close(fd)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        return Pointer(None, "missing")
    except IsADirectoryError:  # no file can be written in its place either: never ours to delete
        raise PointerError(f"{path} is a folder, not the file naming the newest checkpoint; move it away") from None
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        return Pointer(None, f"unreadable ({why})")
    tag = text.strip()
    if not tag:
        return Pointer(None, "empty")
    check_tag_name(Path(root), tag)
    return Pointer(tag)


def check_tag_name(root: Path, tag: str) -> None:
    """Refuse a `tag` read from `root`/latest that is no tag folder directly inside `root`."""
    shown = tag if len(tag) <= 200 else f"{tag[:200]}..."
    if not TAG_PATTERN.fullmatch(tag):
        raise PointerError(f"{root / LATEST} names {shown!r}: no checkpoint tag (phaseN-stepNNNNNNN, a folder "
                           f"directly inside {root}); write the tag to resume from into it, or remove the file")
    if (root / tag).is_symlink():
        raise PointerError(f"{root / LATEST} names {tag!r}, a symbolic link (to {os.readlink(root / tag)}): a "
                           f"checkpoint is a folder of its own inside {root}")


# ---------------------------------------------------------------------- manifests
def file_owner(name: str) -> int:
    """The rank that writes a checkpoint file: the one in its name, else rank 0."""
    match = _RANK_FILE.match(name)
    return int(match.group(1)) if match else 0


def owned_names(folder: Path, rank: int, prefix: str = "") -> Iterator[str]:
    """Relative paths of the files in `folder` that `rank` wrote, chosen by name from the directory listing
    (temp files and the unlisted ones left out).

    Nothing another rank wrote is stat'ed: with 256 ranks each stat-ing all ~770 files of a tag, one save
    was ~200k metadata operations on the shared file system at once. A rank-named entry is decided by its
    name alone; another name is a subfolder (walked, told by the listing's entry type, which Linux file
    systems return without a stat) or one of rank 0's few files.
    """
    with os.scandir(folder) as listing:
        for entry in listing:
            rel = prefix + entry.name
            if entry.name.startswith(".") or rel in _UNLISTED:
                continue
            named = _RANK_FILE.match(entry.name)
            if named is not None:
                if int(named.group(1)) == rank:
                    yield rel
            elif entry.is_dir(follow_symlinks=False):
                yield from owned_names(Path(entry.path), rank, f"{rel}/")
            elif rank == 0:
                yield rel


def own_entries(folder: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file in `folder` that `rank` wrote (see `owned_names`)."""
    entries = {}
    for rel in sorted(owned_names(folder, rank)):
        path = folder / rel
        status = path.stat()
        if stat.S_ISREG(status.st_mode):
            entries[rel] = {"size": status.st_size, "sha256": sha256_file(path), "rank": rank}
    return entries


@dataclass
class Gathered:
    """Every rank's part of one save, as each rank has it after `gather_entries`."""

    files: dict[str, dict[str, Any]]  # this folder's files from every rank (what the manifest lists)
    failures: list[str]  # every rank's write failure, world-wide (empty: every write went through)
    seconds: float  # this rank's hashing time


def gather_entries(folder: Path, rank: int, failure: str | None) -> Gathered:
    """Collective over the world (every rank of every model saving now): each rank hashes the files it wrote
    (none after a failed write: the save fails anyway) and sends them with its failure, if any."""
    began = time.perf_counter()
    mine: dict[str, dict[str, Any]] = {}
    if failure is None:
        try:
            mine = own_entries(folder, rank)
        except OSError as err:  # a file this rank wrote cannot be read back (EIO): the save fails
            failure = f"rank {rank}: reading back {folder.name}: {err}"
    seconds = time.perf_counter() - began
    gathered: list[Any] = [(str(folder), mine, failure)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = all_gather_json(gathered[0])  # as JSON (lists for tuples): a peer's bytes are never unpickled
    files: dict[str, dict[str, Any]] = {}
    for where, entries, _ in gathered:
        if where == str(folder):
            files.update(entries)
    return Gathered(files, [why for _, _, why in gathered if why], seconds)


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], world_size: int) -> None:
    """Rank 0, once every rank's files are written: MANIFEST.json, the tag's commit marker (temp file, fsync,
    rename, then the folder's fsync). A tag folder without it is a save that did not finish."""
    atomic_write_json(folder / MANIFEST, {"tag": folder.name, "world_size": world_size, "files": files})
    fsync_folder(folder)


def manifest_bytes(folder: Path) -> int | None:
    """The bytes a whole checkpoint holds, from its manifest (None: no readable manifest)."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
        return sum(entry["size"] for entry in files.values()) + (folder / MANIFEST).stat().st_size
    except (OSError, ValueError, KeyError):
        return None


def damage(folder: Path, named_by_latest: bool = True) -> str | None:
    """Why the checkpoint in `folder` cannot be trusted (one phrase naming the file), or None if it is whole.

    Without a manifest: the tag `latest` names predates manifests (ours is moved only after the manifest is
    written) and is taken as it is; any other tag is a save that did not finish."""
    if not folder.is_dir():
        return "the folder is missing"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None if named_by_latest else f"no {MANIFEST} (a save that did not finish)"
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError) as err:
        return f"{MANIFEST} is unreadable ({err})"
    for rel, entry in sorted(files.items()):
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{rel} has {size} bytes, {entry['size']} were written"
        if sha256_file(path) != entry["sha256"]:
            return f"{rel} differs from what was written (sha256)"
    return None


@dataclass(frozen=True)
class TagScan:
    """Rank 0's look at the checkpoint folder before a resume: what `latest` says and the tag folders there."""

    pointer: Pointer
    tags: dict[str, bool]  # every tag folder (no symbolic links) -> committed (holds its MANIFEST.json)

    @classmethod
    def of(cls, root: Path) -> TagScan:
        """Raises PointerError when `latest` names no tag folder of `root`."""
        pointer = read_latest(root) if root.is_dir() else Pointer(None, "missing")
        tags = {}
        if root.is_dir():
            for path in root.iterdir():
                if TAG_PATTERN.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                    tags[path.name] = (path / MANIFEST).is_file()
        return cls(pointer, tags)

    @property
    def bound(self) -> str | None:
        """The newest tag a save finished: `latest`'s, or without one the newest committed tag (None: none)."""
        committed = [tag for tag, done in self.tags.items() if done]
        return self.pointer.tag or max(committed, key=tag_order, default=None)

    def unfinished(self) -> list[str]:
        """Tags without a commit marker newer than the bound: saves that did not finish (the only ones deleted)."""
        bound = tag_order(self.bound) if self.bound else ("", -1)
        return sorted((tag for tag, done in self.tags.items() if not done and tag_order(tag) > bound), key=tag_order)

    def candidates(self) -> list[str]:
        """The tags a resume may take, newest first: every tag folder left (committed ones newer than `latest`
        included) and the tag `latest` names (its folder may be missing: reported as such)."""
        dropped = set(self.unfinished())
        kept = {tag for tag in self.tags if tag not in dropped} | ({self.pointer.tag} if self.pointer.tag else set())
        return sorted(kept, key=tag_order, reverse=True)


def resolve_resume_tag(root: Path, rank: int, label: str = "checkpoint.dir") -> str | None:
    """The tag to resume from (None: start fresh), agreed by every rank; see the module docstring.

    Collective over the world. Votes: ("tag", t) the newest intact tag <= the bound, ("fresh", "") no
    checkpoint, ("broken", why) nothing intact or a `latest` refused, ("abstain", "") ranks other than a
    model's rank 0. `rank`: this process's rank in its model's job (codistillation: in its group).
    """
    root, first = Path(root), rank == 0
    scan, refused = None, None
    if first:
        try:
            scan = TagScan.of(root)
        except PointerError as err:
            refused = f"{label}: {err}"  # nothing is deleted or resumed because of such a pointer
        else:
            drop_unfinished(root, scan)
    pointer = scan.pointer.tag if scan else None
    candidates = scan.candidates() if scan else []
    verdicts: dict[str, str | None] = {}
    bound: tuple[str, int] | None = None
    began = time.perf_counter()
    while True:
        vote: tuple[str, str] = ("abstain", "")
        if first:
            vote = ("broken", refused or "") if refused or candidates else ("fresh", "")
            for tag in candidates:
                if bound is not None and tag_order(tag) > bound:
                    continue
                if tag not in verdicts:
                    verdicts[tag] = damage(root / tag, named_by_latest=tag == pointer)
                if verdicts[tag] is None:
                    vote = ("tag", tag)
                    break
            if vote == ("broken", ""):
                reasons = "; ".join(f"{t}: {verdicts[t]}" for t in candidates if verdicts.get(t))
                vote = ("broken", f"{label}: no intact checkpoint to resume from in {root} ({reasons})")
        votes: list[Any] = [vote]
        if dist.is_initialized() and dist.get_world_size() > 1:
            votes = all_gather_json(vote)  # [kind, why] lists, read as the pairs
        votes = [v for v in votes if v[0] != "abstain"]
        broken = [why for kind, why in votes if kind == "broken"]
        if broken:
            raise ResumeError(" | ".join(dict.fromkeys(broken)))
        kinds = {kind for kind, _ in votes}
        if kinds == {"fresh"}:
            return None
        if "fresh" in kinds:
            raise ResumeError(f"{label}: some codistillation groups have checkpoints and others none")
        tags = {tag for _, tag in votes}
        if len(tags) == 1:
            chosen = tags.pop()
            break
        bound = min(tag_order(t) for t in tags)
    if first and scan is not None:
        _set_aside(root, scan.pointer, chosen, verdicts, time.perf_counter() - began)
    if dist.is_initialized():
        dist.barrier()  # the pointer and folders are in place before anyone reads them
    return chosen


def drop_unfinished(root: Path, scan: TagScan) -> None:
    """Rank 0 of a model, at resume: delete the tag folders without a manifest newer than the bound (`latest`'s
    tag, else the newest committed one), saves that never finished (a crash, a full disk): never trusted, and
    the resumed run writes those steps again into clean folders. Said in one line. A committed tag is never
    deleted here, whatever `latest` says."""
    unfinished = [root / tag for tag in scan.unfinished()]
    for folder in unfinished:
        aside = root / f"{PRUNED_PREFIX}{folder.name}-unfinished"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)
    if unfinished:
        names = ", ".join(p.name for p in unfinished)
        if scan.pointer.tag:
            why = f"newer than latest ({scan.pointer.tag}), saves that did not finish"
        elif scan.bound:
            why = (f"no {MANIFEST}, newer than the newest committed checkpoint ({scan.bound}; latest is "
                   f"{scan.pointer.problem}), saves that did not finish")
        else:
            why = f"no {MANIFEST} and no committed checkpoint beside them (latest is {scan.pointer.problem}), " \
                  "saves that did not finish"
        print(f"checkpoint.dir: ignored and deleted {names} in {root}: {why}", flush=True)


def _set_aside(root: Path, pointer: Pointer, chosen: str, verdicts: dict[str, str | None], seconds: float) -> None:
    """Move damaged tags newer than `chosen` aside, point `latest` at `chosen`, say so in one line each (and
    why `latest` moved when it named another tag or none)."""
    for tag, why in verdicts.items():
        if why is None or tag_order(tag) <= tag_order(chosen):
            continue
        aside = root / f"{tag}.damaged"
        suffix = 1
        while aside.exists():
            aside, suffix = root / f"{tag}.damaged{suffix}", suffix + 1
        if (root / tag).exists():
            os.replace(root / tag, aside)
        print(f"checkpoint {root / tag} is damaged: {why}; moved to {aside.name}, resuming from {chosen}", flush=True)
    if pointer.tag is None:
        print(f"checkpoint.dir: {root / LATEST} is {pointer.problem}; resuming from {chosen}, the newest committed "
              "checkpoint that verifies (latest now names it)", flush=True)
    elif tag_order(chosen) > tag_order(pointer.tag):
        print(f"checkpoint.dir: {chosen} in {root} is committed (its {MANIFEST}) but newer than latest "
              f"({pointer.tag}): resuming from {chosen} (latest now names it)", flush=True)
    if pointer.tag != chosen:
        atomic_write_bytes(root / LATEST, chosen.encode("utf-8"))
    elif chosen in verdicts and (root / chosen / MANIFEST).is_file():
        print(f"checkpoint {root / chosen} verified against its manifest in {seconds:.2f} s", flush=True)
