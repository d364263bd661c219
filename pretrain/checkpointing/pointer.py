"""What `latest` names, checked before anything is loaded, kept or deleted because of it.

`latest` is one small file that a person, a copy (`cp -r phase*`), a sync tool or a scratch purge can remove,
empty or rewrite, so resume never takes it on trust:

- missing, empty or unreadable: no pointer. That is said (`Pointer.problem`), and resume looks at the tags
  themselves: the committed ones (each has its MANIFEST.json) are kept and the newest that verifies is resumed
  (pretrain/checkpointing/manifest.py);
- a value that is no tag name (`phaseN-stepNNNNNNN`: no absolute path, no `..`, no separator) or names a
  symbolic link is refused in one line naming the file and the value (PointerError): a pointer someone wrote
  to load a folder outside the checkpoint folder, or a typo, is no reason to resume from anything else.

Standard library and the ground floor only, so every reader of `latest` can use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pretrain.checkpointing.layout import LATEST, TAG_PATTERN
from pretrain.errors import ResumeError

_MOST_BYTES = 4096  # a tag name is ~20 bytes: never read a huge or endless file whole


class PointerError(ResumeError):
    """`latest` names something that is no tag folder of its checkpoint folder (the message names both)."""


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
