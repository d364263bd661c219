"""One self-test per host, remembered: both stages in one child, the verdict cached in the run folder.

Why: each launch and each elastic restart used to pay two child processes (seconds each: an interpreter, torch's
import) and a cold compile of the compiled layer (tens of seconds), on every rank that was its node's local rank 0
(with one GPU per task, every rank). The verdict depends on the host's device and software and on the shapes
tested, none of which a restart changes; so

- the kernel stage and the compiled-layer stage (pretrain/device_check/unpadded_check.py, compiled_check.py) run
  one after the other in one child process (pretrain/device_check/contained.py), on a CUDA device; in the rank
  elsewhere (no context to poison);
- a child that cannot open the device ("busy or unavailable": a GPU in exclusive-process mode, which the rank
  already holds) is answered by running the stages in the rank itself;
- the verdict is written to the run folder (pretrain/run_folder.py `device_check_path`, one file per host,
  atomically) with its key: the host, the device (the GPU's UUID; on a CPU its architecture), the driver, torch's
  and CUDA's versions, the dtype, head size, seq length and shapes of each stage, the tests' names and a hash of
  the code that tests and is tested (`code_version`). A later launch or restart whose key is the same reads the
  verdict instead of testing; any other key tests again and replaces the file. A verdict whose test could not
  finish (an error, a dead or silent child) is not kept: it may be the moment's, not the host's.

The cache file is read only when it is a regular file of this user's that neither group nor others may write (a
planted "passed" would otherwise skip the test); anything else in its place is ignored and the test runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import platform
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.device_check.contained import SelfTest, stages_in_child
from pretrain.device_check.run_shape import RunShape
from pretrain.device_check.verdict import SelfTestResult
from pretrain.run_folder import device_check_path

BUSY = "busy or unavailable"  # CUDA's words when another process holds a GPU in exclusive-process mode
CACHE_LIMIT = 1 << 20  # bytes: a verdict file is a few hundred
# the modules whose code decides a verdict: the tests and what they test (a change in any re-runs the test)
CODE = ("pretrain.device_check.kernel_check", "pretrain.device_check.unpadded_check",
        "pretrain.device_check.compiled_check", "pretrain.device_check.run_shape", "pretrain.device_check.verdict",
        "pretrain.model.varlen_attention", "pretrain.model.unpadded", "pretrain.model.compiled")


@dataclass(frozen=True)
class Stage:
    """One stage's arguments: the dtype, head size, longest seq_len and the run's shapes it tests at."""

    test: SelfTest
    precision: str
    head_dim: int
    seq_len: int
    shape: RunShape


@dataclass(frozen=True)
class HostCheck:
    """What a host tests on `device`: the kernel stage, then (where a phase compiles, and the kernel passed) the
    compiled layer's. `in_child`: run in a child process (None: on a CUDA device only; the tests' seam)."""

    device: torch.device
    kernel: Stage
    compiled: Stage | None
    in_child: bool | None = None

    def wheres(self) -> list[str]:
        """Each stage's device and dtype, as a dead child's verdict names them."""
        return [f"{self.device} {self.kernel.precision}",
                *([f"{self.device} {self.compiled.precision} compiled layer"] if self.compiled else [])]


@dataclass(frozen=True)
class HostVerdict:
    """The host's verdicts (compiled: None where it was not tested; each says whether it came from the cache)."""

    kernel: SelfTestResult
    compiled: SelfTestResult | None


def run_stages(check: HostCheck) -> Iterator[SelfTestResult]:
    """The kernel stage's verdict, then the compiled layer's where it is asked for and the kernel passed. Module-level:
    a spawned child imports it by name."""
    kernel = check.kernel
    result = kernel.test(check.device, kernel.precision, kernel.head_dim, kernel.seq_len, kernel.shape)
    yield result
    if check.compiled is not None and result.passed:
        compiled = check.compiled
        yield compiled.test(check.device, compiled.precision, compiled.head_dim, compiled.seq_len, compiled.shape)


def run_check(check: HostCheck) -> HostVerdict:
    """The stages, contained per the module docstring: in one child on CUDA; in this process when the child could
    not open the device, or off CUDA."""
    in_child = check.device.type == "cuda" if check.in_child is None else check.in_child
    results = stages_in_child(run_stages, (check,), check.wheres()) if in_child else []
    if not in_child or any(BUSY in (r.failure or "") for r in results):
        results = list(run_stages(check))
    if not results:  # a child that ended its stages without a verdict (none of ours does)
        results = [SelfTestResult(False, check.wheres()[0], failure="its process gave no verdict")]
    return HostVerdict(results[0], results[1] if len(results) > 1 else None)


def checked_host(check: HostCheck, run_dir: Path | None, host: str) -> HostVerdict:
    """The host's verdict: from the run folder's cache where its key is this check's, else tested now (and cached
    when the test finished). `run_dir` None: no cache (a plan with no run folder: the tests' stubs)."""
    key = cache_key(check, host)
    path = None if run_dir is None else device_check_path(run_dir, host)
    cached = None if path is None else read_cached(path, key)
    if cached is not None:
        return cached
    verdict = run_check(check)
    finished = all(r.failure is None for r in (verdict.kernel, verdict.compiled) if r is not None)
    if path is not None and finished:
        record = {"key": key, "kernel": dataclasses.asdict(verdict.kernel),
                  "compiled": None if verdict.compiled is None else dataclasses.asdict(verdict.compiled)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, record)
        except OSError as err:  # a verdict not kept costs the next launch a test, not this run its start
            print(f"note: the self-test's verdict could not be kept in {path} ({err.strerror or err}); the next "
                  "launch tests again", flush=True)
    return verdict


def read_cached(path: Path, key: dict[str, Any]) -> HostVerdict | None:
    """The verdict `path` holds for `key`; None when it holds another key's, or is missing, unreadable, not this
    user's alone (module docstring) or not a verdict."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022 \
                or info.st_size > CACHE_LIMIT:
            return None
        try:
            record = json.loads(handle.read(CACHE_LIMIT + 1).decode("utf-8"))
            if record["key"] != key:
                return None
            kernel, compiled = (None if fields is None else dataclasses.replace(SelfTestResult(**fields), cached=True)
                                for fields in (record["kernel"], record["compiled"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None
    return HostVerdict(kernel, compiled) if kernel is not None else None


def cache_key(check: HostCheck, host: str) -> dict[str, Any]:
    """What the verdict depends on (module docstring), as JSON reads it back (tuples as lists)."""
    stages = {name: None if stage is None else {
        "test": stage_name(stage.test), "precision": stage.precision, "head_dim": stage.head_dim,
        "seq_len": stage.seq_len, "shape": dataclasses.asdict(stage.shape)}
        for name, stage in (("kernel", check.kernel), ("compiled", check.compiled))}
    key = {"host": host, "device": device_identity(check.device), "driver": driver_version(check.device),
           "torch": torch.__version__, "cuda": torch.version.cuda, **stages,
           "code": code_version(tuple(sorted({*CODE, *(stage_module(s.test) for s in (check.kernel, check.compiled)
                                                         if s is not None)})))}
    return json.loads(json.dumps(key))


def device_identity(device: torch.device) -> str:
    """The GPU's UUID (its name where torch gives none); on a CPU a stable stand-in: the machine's architecture."""
    if device.type != "cuda":
        return f"{device.type} {platform.machine()} {platform.processor()}".strip()
    properties = torch.cuda.get_device_properties(device)
    return str(getattr(properties, "uuid", "") or properties.name)


def driver_version(device: torch.device) -> str:
    """The NVIDIA driver's version (its kernel module's line), 'none' off CUDA, 'unknown' where it cannot be read."""
    if device.type != "cuda":
        return "none"
    try:
        return Path("/proc/driver/nvidia/version").read_text(encoding="utf-8").splitlines()[0].strip()
    except (OSError, IndexError):
        return "unknown"


def stage_name(test: SelfTest) -> str:
    """A test's module and name; a partial's with its keywords (a planted kernel is another test)."""
    if isinstance(test, functools.partial):
        words = ", ".join(f"{k}={getattr(v, '__qualname__', repr(v))}" for k, v in sorted(test.keywords.items()))
        return f"{stage_name(test.func)}({words})"
    return f"{getattr(test, '__module__', '?')}.{getattr(test, '__qualname__', repr(test))}"


def stage_module(test: SelfTest) -> str:
    return getattr(test.func if isinstance(test, functools.partial) else test, "__module__", "") or ""


@functools.cache
def code_version(modules: tuple[str, ...]) -> str:
    """sha256 (first 16 hex digits) of the source of `modules` (those with a source file)."""
    digest = hashlib.sha256()
    for name in modules:
        file = source_file(name)
        if file is not None:
            digest.update(name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def source_file(module: str) -> Path | None:
    """The source file of `module`: the loaded one's, else where an import would find it (None: no file, e.g. a
    built-in, or a script's __main__ with no file)."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if file is None and module:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # ValueError: a module without a spec (a script run as __main__)
            spec = None
        file = spec.origin if spec is not None else None
    return Path(file) if file and Path(file).is_file() else None
