"""Every checkpoint file is read as data: `torch.load(weights_only=True)` with one short, explicit allowlist.

A checkpoint is a folder of pickles, and a pickle can name any importable function to call while it loads
(`os.system`, say). Checkpoints come from other people: a colleague's run on the shared file system, a
download, a config whose `phaseN.init_from` or `checkpoint.dir` names someone else's folder. torch's
`weights_only=True` unpickler builds only tensors, containers and plain values, plus the classes listed
here; anything else stops the load before it is built, and `load_data` turns torch's long message into one
line naming the file and the type (UnsafeCheckpointError: the driver prints it and exits 2).

The allowlist is what DeepSpeed 0.19.8 writes into the checkpoints of the precisions and ZeRO stages the
toolkit runs (fp32, fp16 and bf16 at ZeRO-0, -1, -2 and -3, BF16_Optimizer included), found by saving
real ones (tests/checkpointing/test_safe_load.py saves them again and loads them through here). Each
entry is one class that holds plain values (a loss scaler's numbers, an enum, a dataclass of two ints),
never a module and never a function. DeepSpeed's own loads (its checkpoint engine forces
`weights_only=False`) come here through pretrain/checkpointing/commit.py `SafeLoads`.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import IO, Any

import torch

from pretrain.errors import SAVE_ERROR_PREFIX, UserError

__all__ = ["UnsafeCheckpointError", "allowed_globals", "load_data", "refused"]


class UnsafeCheckpointError(UserError):
    """A checkpoint file that needs a type outside the allowlist: not loaded (it could run code as you). The
    message names the file and the type; the driver prints it in one line and exits 2."""

    prefix = SAVE_ERROR_PREFIX


@cache
def allowed_globals() -> tuple[type, ...]:
    """The classes besides tensors and plain containers a checkpoint of ours may hold (module docstring)."""
    # deferred: DeepSpeed takes seconds to import, and only a load needs these
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)


@contextmanager
def allowlist() -> Iterator[None]:
    """torch's weights-only unpickler accepts the allowlisted classes inside this block."""
    with torch.serialization.safe_globals(list(allowed_globals())):
        yield


# torch's words for the global it refused: "Unsupported global: GLOBAL posix.system was not an allowed global"
_GLOBAL = re.compile(r"GLOBAL (\S+)")
_WHY = re.compile(r"WeightsUnpickler error: ([^\n]+)")


def refused(path: str | Path, err: pickle.UnpicklingError) -> UnsafeCheckpointError:
    """torch's refusal (many lines, with advice to turn the check off) as our one line."""
    text = str(err)
    found = _GLOBAL.search(text)
    if found:
        what = found.group(1)
    else:
        why = _WHY.search(text)
        what = why.group(1).strip().rstrip(".") if why else "what torch's weights-only reader refuses"
    return UnsafeCheckpointError(f"{path}: refused: it needs {what}, which a checkpoint of this toolkit never "
                                 "holds (checkpoints are read as data only; a file that needs more may run code)")


def load_data(source: str | Path | IO[bytes], map_location: Any = "cpu", mmap: bool = False,
              name: str | Path | None = None) -> Any:
    """`torch.load(source, weights_only=True)` with the allowlist; UnsafeCheckpointError names `name` (or the
    path) and the type when the file needs anything else. Other failures (a truncated file) are torch's."""
    try:
        with allowlist():
            return torch.load(source, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as err:
        raise refused(name if name is not None else source, err) from None
