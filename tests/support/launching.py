"""Run a script on several CPU ranks (gloo backend) through torchrun, one of the driver's documented launchers.

Why torchrun and not the `deepspeed` launcher here: the DeepSpeed launcher is two more Python processes that
import torch and DeepSpeed before any rank starts (~7 s of a 2-core machine per launch, measured with a script
that only prints its rank: 8.7-9.4 s against 2.3 s), and the suite launches ranks dozens of times. The ranks
get what the DeepSpeed launcher would give them beyond torchrun's variables (LOCAL_SIZE, which DeepSpeed's
CPU all-reduce reads to use shared memory; CROSS_RANK / CROSS_SIZE), so they take the same paths. The
DeepSpeed launcher itself is exercised where the product uses it: every test of launch.sh (tests/launch/).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from pretrain.distributed.step_watch import HOLD_FILE_ENV, TEARDOWN, step_scope
from tests.support.paths import REPO_ROOT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# An in-process engine (init_distributed in a lone test process) exports these and keeps its
# rendezvous port open; a child that inherited them would try to listen on that same port.
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child process, without its torch.distributed rendezvous."""
    env = {name: value for name, value in os.environ.items() if name not in RENDEZVOUS_VARS}
    env.update(extra)
    return env


def deepspeed_cpu_env() -> dict[str, str]:
    env = child_env()
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    # One intra-op thread per rank: 2 ranks on 2 cores must not oversubscribe.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start_ranks(
    script: str | Path,
    args: list[str] | None = None,
    num_ranks: int = 2,
    cwd: str | Path | None = None,
) -> subprocess.Popen[str]:
    """Start N ranks of `script args` on CPU (own rendezvous port) without waiting for it. Like the DeepSpeed
    launcher, torchrun ends the other ranks when one fails, and exits non-zero."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(num_ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(script), *(args or [])]
    env = deepspeed_cpu_env() | {"LOCAL_SIZE": str(num_ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1",
                                 "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, env=env, cwd=str(cwd or REPO_ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_ranks(proc: subprocess.Popen[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Wait for a `start_ranks` launch and fail loudly with its output."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, proc.args))} exited {proc.returncode}\n--- stdout ---\n{stdout[-8000:]}"
            f"\n--- stderr ---\n{stderr[-8000:]}"
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_ranks(
    script: str | Path,
    args: list[str] | None = None,
    num_ranks: int = 2,
    timeout: float = 900,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run N ranks of `script args` on CPU (start_ranks) and fail loudly with their output."""
    return finish_ranks(start_ranks(script, args, num_ranks, cwd), timeout)


FAKE_PYTHON = "/opt/py/bin/python3"  # launch.sh prints it as $PYTHON under --dry-run, never runs it


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without anything that would change launch.sh's choices."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("SLURM_")
        and key not in {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_DEBUG", "PYTHONPATH", "DS_ACCELERATOR"}
    }
    env["PYTHON"] = FAKE_PYTHON
    env.update(extra)
    return env


def copy_machine_op_build(root: Path, name: str = "deepspeed_shm_comm") -> Path:
    """`root/name`: a copy of this machine's build of DeepSpeed's JIT op `name` (without its lock), for a
    TORCH_EXTENSIONS_DIR of a test's own; an empty folder when the machine has none (the first load there
    compiles it)."""
    from torch.utils.cpp_extension import get_default_build_root

    built = [p for p in Path(get_default_build_root()).glob(f"py*/{name}") if (p / "build.ninja").is_file()]
    if built:
        shutil.copytree(built[0], root / name, ignore=shutil.ignore_patterns("lock"))
    (root / name).mkdir(parents=True, exist_ok=True)
    return root / name


def leave_without_teardown(status: int = 0) -> None:
    """End a rank script run by the tests with `status`, its streams flushed, without the interpreter's teardown:
    with the process group still up, a C++ thread torch left joinable can abort the process at exit ("terminate
    called without an active exception", SIGABRT), which the driver avoids the same way (pretrain.train.exit_now).
    A script that fails raises before this, with its traceback and a non-zero status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class Hold:
    """A test's hold file (pretrain/distributed/step_watch.py HOLD_FILE_ENV): every rank of a run started with `env`
    waits before the step the file names, for as long as it does. A fault test holds the run at a known step, acts
    (kills, freezes), then moves the hold on or releases it: paced by the run's own progress, never by the machine's
    speed."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def env(self) -> dict[str, str]:
        return {HOLD_FILE_ENV: str(self.path)}

    def at(self, step: int, phase: str = "phase1") -> Hold:
        """Hold before `phase` step `step` (and any later one) from now on."""
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(step_scope(phase, step), encoding="utf-8")
        os.replace(temporary, self.path)
        return self

    def at_teardown(self) -> Hold:
        """Hold every rank on its way out, after its last step, with its teardown timer running: a rehearsed hang at
        exit (pretrain/distributed/step_watch.py StepWatch.teardown). Releases any step hold."""
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(TEARDOWN, encoding="utf-8")
        os.replace(temporary, self.path)
        return self

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
