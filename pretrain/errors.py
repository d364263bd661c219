"""The errors a user fixes, on the ground floor: every module may raise them, none imports upward for them.

`UserError` means "the run cannot start or continue; the message names the key or file": the entry
point prints it in one line with its kind's prefix and exits 2, without a traceback. Its kinds:

    ConfigError   "config error: "   a value of the run config is wrong (the message starts with the dotted key)
    DataError     "data error: "     the data does not fit the run (shards, vocab, initial weights' vocab)
    ResumeError   "resume error: "   the checkpoint folder cannot be resumed (nothing intact, an older format,
                                     a conversion that failed): a damaged checkpoint is no config error
    FinetuneFormatError  "error: "   a fine-tune's input file, model folder or flag (SquadFormatError and
                                     GlueFormatError are its kinds; pretrain/finetune/common.py prints it)

Standard library only, so the typed config sections, the checkpoint code, the plug-ins and the fine-tunes'
torch-free scorers can all use it.
"""

from __future__ import annotations


class UserError(ValueError):
    """The run cannot start or continue; the message names the key or file. The entry point exits 2."""

    prefix = "error: "

    def line(self) -> str:
        """What the entry point prints: the kind's prefix, then the message."""
        return f"{self.prefix}{self}"


class ConfigError(UserError):
    """A configuration value is wrong; the message names the dotted key."""

    prefix = "config error: "


class DataError(UserError):
    """The data does not fit the run (missing shards, another vocab); the message names the key or file."""

    prefix = "data error: "


class ResumeError(UserError):
    """The checkpoint folder cannot be resumed from (nothing intact, an older format, a failed conversion)."""

    prefix = "resume error: "


class FinetuneFormatError(UserError):
    """A fine-tune's input file, model folder or flag that cannot be used as it is (SquadFormatError and
    GlueFormatError are its kinds, one per task's files)."""
