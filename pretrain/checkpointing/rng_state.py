"""Each rank's random number generators in a checkpoint (`rng_rankNNNNN.pt`), stored as tensors and plain values.

The file holds torch's generator (a byte tensor; CUDA's too where there is one), numpy's legacy MT19937 state
(its 624 words as a tensor, position, cached Gaussian) and Python's `random` state (its 625 words as a
tensor), written with torch.save and read back with `weights_only=True` (safe_load.py): nothing in it can name
code to run.

Checkpoints of the previous release hold a plain `pickle.dumps` of `{"torch": ByteTensor, "numpy":
np.random.get_state(), "python": random.getstate()}` (and "cuda"). Such a file is read by `LegacyRngReader`, an
Unpickler whose `find_class` answers only the names that structure needs, each by a function of ours that
checks what it builds (uint32 numpy arrays, uint8 tensors without hooks); every other name is refused in one
line naming the file. torch pickles a tensor's bytes as a nested torch.save file (`torch.storage._load_from_bytes`,
which would call `torch.load(weights_only=False)`): that nested file is parsed here instead.
"""

from __future__ import annotations

import io
import pickle
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.checkpointing.safe_load import UnsafeCheckpointError, load_data
from pretrain.errors import ResumeError

__all__ = ["capture", "read_rng", "restore", "rng_file_name", "write_rng"]
FORMAT = "bert-ds-rng/2"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format; the previous release's files are bare pickles


def rng_file_name(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def capture() -> dict[str, Any]:
    """This process's generator states, in the runtime's own types (what `restore` takes)."""
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def restore(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def to_data(rng: dict[str, Any]) -> dict[str, Any]:
    """The states as tensors and plain values (what the file holds)."""
    kind, key, pos, has_gauss, cached = rng["numpy"]
    version, words, gauss = rng["python"]
    data = {"format": FORMAT, "torch": rng["torch"],
            "numpy": {"kind": str(kind), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64),
                       "gauss": None if gauss is None else float(gauss)}}
    if "cuda" in rng:
        data["cuda"] = rng["cuda"]
    return data


def from_data(data: Any, path: Path) -> dict[str, Any]:
    """`to_data`'s inverse, checking the shape of what it reads (a foreign file: one line naming it)."""
    try:
        numpy_state, python_state = data["numpy"], data["python"]
        rng = {"torch": _bytes(data["torch"]),
               "numpy": (numpy_state["kind"], numpy_state["key"].numpy().astype(np.uint32), int(numpy_state["pos"]),
                         int(numpy_state["has_gauss"]), float(numpy_state["cached_gaussian"])),
               "python": (int(python_state["version"]), tuple(int(w) for w in python_state["state"].tolist()),
                          python_state["gauss"])}
        if "cuda" in data:
            rng["cuda"] = _bytes(data["cuda"])
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise ResumeError(f"{path}: not an RNG state file of this toolkit ({type(err).__name__}: {err})") from None
    return rng


def _bytes(value: Any) -> torch.Tensor:
    if not (torch.is_tensor(value) and value.dtype == torch.uint8 and value.dim() == 1):
        raise TypeError("a generator state is a 1-D uint8 tensor")
    return value


def write_rng(path: Path) -> bytes:
    """The file's bytes for this process's states (the caller writes them atomically)."""
    buffer = io.BytesIO()
    torch.save(to_data(capture()), buffer)
    return buffer.getvalue()


def read_rng(path: Path) -> dict[str, Any]:
    """The states saved in `path`, this format or the previous release's (module docstring), for `restore`."""
    raw = path.read_bytes()
    try:
        if raw.startswith(ZIP_MAGIC):
            return from_data(load_data(io.BytesIO(raw), name=path), path)
        legacy = LegacyRngReader(io.BytesIO(raw), path).load()
    except (UnsafeCheckpointError, ResumeError):
        raise
    except Exception as err:  # a truncated or garbled file, whatever the reader raised: name it
        why = (str(err).strip().splitlines() or [""])[0][:120]
        raise ResumeError(f"{path}: not an RNG state file of this toolkit ({type(err).__name__}: {why})") from None
    if not (isinstance(legacy, dict) and {"torch", "numpy", "python"} <= set(legacy)):
        raise ResumeError(f"{path}: not an RNG state file of this toolkit")
    return from_data(to_data(legacy), path)  # the same checks as a new file's


# ---------------------------------------------------------------------- the previous release's pickles
class _Refusing(pickle.Unpickler):
    """An Unpickler that answers only `allowed` names; anything else is refused naming `path`."""

    allowed: dict[tuple[str, str], Any] = {}

    def __init__(self, file: io.BytesIO, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(f"{self.path}: refused: it needs {module}.{name}, which an RNG state file "
                                        "never holds (checkpoints are read as data only; a file that needs more "
                                        "may run code)")
        return found


class LegacyRngReader(_Refusing):
    """The previous release's `pickle.dumps` of the RNG dict: its names only (module docstring)."""

    def __init__(self, file: io.BytesIO, path: Path) -> None:
        super().__init__(file, path)
        reconstruct = self._array
        self.allowed = {("torch._utils", "_rebuild_tensor_v2"): self._tensor,
                        ("torch.storage", "_load_from_bytes"): self._storage,
                        ("collections", "OrderedDict"): OrderedDict,
                        ("numpy._core.multiarray", "_reconstruct"): reconstruct,  # numpy 2
                        ("numpy.core.multiarray", "_reconstruct"): reconstruct,  # numpy 1
                        ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): self._dtype}

    def _storage(self, nested: bytes) -> torch.Tensor:
        return _LegacyStorage.read(nested, self.path)

    def _tensor(self, storage: Any, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                requires_grad: bool, hooks: Any, *metadata: Any) -> torch.Tensor:
        if not torch.is_tensor(storage) or requires_grad or hooks or metadata:
            raise UnsafeCheckpointError(f"{self.path}: refused: a tensor with hooks or without plain bytes")
        return torch.as_strided(storage, tuple(size), tuple(stride), int(offset)).clone()

    def _array(self, subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
        if subtype is not np.ndarray:
            raise UnsafeCheckpointError(f"{self.path}: refused: an array of type {subtype!r}")
        return np.ndarray.__new__(np.ndarray, shape, dtype)

    def _dtype(self, name: Any, align: bool = False, copy: bool = False) -> np.dtype:
        if name != "u4":  # numpy's MT19937 key: uint32
            raise UnsafeCheckpointError(f"{self.path}: refused: a numpy array of dtype {name!r}")
        return np.dtype(name, align, copy)


class _LegacyStorage(_Refusing):
    """torch's legacy torch.save of one untyped storage (how pickle carries a tensor's bytes): five pickles, then
    the bytes. The only name it holds is the storage class (a byte storage), in its persistent id."""

    allowed = {("torch", "ByteStorage"): "bytes", ("torch.storage", "UntypedStorage"): "bytes"}  # both: uint8

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[:2] == ("storage", "bytes")):
            raise UnsafeCheckpointError(f"{self.path}: refused: a tensor stored as {pid!r:.80}")
        return pid[2], int(pid[4])  # (key, number of bytes)

    @classmethod
    def read(cls, nested: bytes, path: Path) -> torch.Tensor:
        handle = io.BytesIO(nested)
        magic, _protocol, _sys_info = (_Refusing(handle, path).load() for _ in range(3))
        if magic != torch.serialization.MAGIC_NUMBER:
            raise ResumeError(f"{path}: a tensor's bytes are not in torch's legacy format")
        key, numel = cls(handle, path).load()
        keys = _Refusing(handle, path).load()
        size = int.from_bytes(handle.read(8), "little")
        data = handle.read(size)
        if keys != [key] or size != numel or len(data) != size:
            raise ResumeError(f"{path}: a tensor's bytes are cut short or laid out otherwise")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
