"""The errors a user fixes, on the ground floor: every module may raise them, none imports upward for them.

`UserError` means "the run cannot start or continue; the message names the key or file": the entry
point prints it in one line with its kind's prefix and exits 2, without a traceback. Its kinds:

    ConfigError   "config error: "   a value of the run config is wrong (the message starts with the dotted key)
    DataError     "data error: "     the data does not fit the run (shards, vocab, initial weights' vocab)
    ResumeError   "resume error: "   the checkpoint folder cannot be resumed (nothing intact, an older format,
                                     a conversion that failed): a damaged checkpoint is no config error
    UnsafeCheckpointError "checkpoint error: "  a checkpoint file that needs a type outside the allowlist
                                     (pretrain/checkpointing/safe_load.py): refused, never unpickled
    FinetuneFormatError  "error: "   a fine-tune's input file, model folder or flag (SquadFormatError and
                                     GlueFormatError are its kinds; pretrain/finetune/common.py prints it)

The exit statuses of the driver (`python -m pretrain.train`) are declared here too, once: the driver returns
them and the elastic agent (pretrain/launch/faults.py) reads them back, with the prefixes of the lines the
driver prints for a user error.

Standard library only, so the typed config sections, the checkpoint code, the plug-ins, the launcher and the
fine-tunes' torch-free scorers can all use it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# The driver's exit statuses besides 0; none of them is restarted by the elastic agent.
USER_ERROR_EXIT = 2  # a config, data or resume error (UserError): one line with its kind's prefix
NONFINITE_EXIT = 3  # too many NaN/inf steps in a row (a checkpoint was written first)
SAVE_FAILED_EXIT = 4  # a phase-end or stop checkpoint (or an export) could not be written; its line is out
# Besides: a persistently slow rank with run.evict_slow and a spare node (pretrain/metrics/slow_ranks.py): every rank
# exits SLOW_EVICT_EXIT after a checkpoint, the slow one's log has EVICT_PREFIX + its host; restarted without it.
SLOW_EVICT_EXIT = 5
EVICT_PREFIX = "evicting host "
# From the launcher's agent to its ranks, each round: how many nodes the job may lose now (0: none; a slow rank is
# evicted only above 0), and their node's name as the launcher's lines give it (the name after EVICT_PREFIX).
NODES_SPARE_ENV = "BERT_DS_NODES_SPARE"
NODE_NAME_ENV = "BERT_DS_NODE_NAME"


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


# A checkpoint or an export that could not be written (pretrain/checkpointing/commit.py SaveError, ExportError; exit 4)
SAVE_ERROR_PREFIX = "checkpoint error: "
EXPORT_ERROR_PREFIX = "export error: "
# The prefixes a rank's error line starts with (UserError.line, SaveError's), the most specific first: the agent
# quotes the rank's own line from its log (pretrain/launch/faults.py).
ERROR_PREFIXES = (*(kind.prefix for kind in (ConfigError, DataError, ResumeError)), SAVE_ERROR_PREFIX,
                  EXPORT_ERROR_PREFIX, UserError.prefix)


def exit_on_error(run: Callable[[], object], errors: type[Exception] | tuple[type[Exception], ...],
                  prefix: str = "") -> int:
    """A command line's tail: `run()`, then exit status 0; one of `errors` is one line on stderr (`prefix` + its
    message, or a UserError's own line without a prefix) and USER_ERROR_EXIT, with no traceback."""
    try:
        run()
    except errors as err:
        line = err.line() if isinstance(err, UserError) and not prefix else f"{prefix}{err}"
        print(line, file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    return 0
