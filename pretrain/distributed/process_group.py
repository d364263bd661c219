"""This process's process group: the rendezvous variables, the backend for the accelerator, the parent-death
signal, and DeepSpeed's CPU shared-memory segments; then `DistInfo`, the value every other module reads. The
group meets in a store whose server listens only where the ranks reach it (pretrain/distributed/rank_store.py),
not on every interface as torch's `env://` server does.

Out of pretrain/engine.py so that joining the job is not tied to building an engine: the driver joins first
(pretrain/train.py), a plug-in builds its groups on top, and a fine-tune or a benchmark joins the same way.
The collective timeout is an argument (the run config's `run.dist_timeout_minutes`), so nothing here reads
the config.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from pretrain.distributed.cluster import device_index, slurm_task_env
from pretrain.distributed.extension_builds import reporting_builds
from pretrain.distributed.info import DistInfo
from pretrain.distributed.lifetime import die_with_parent, parent_death_signal
from pretrain.distributed.rank_store import rank_store_from_env

# DeepSpeed's own default; the driver passes run.dist_timeout_minutes (pretrain/config/sections.py says why longer)
DEFAULT_TIMEOUT_MINUTES = 10

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _fill_rendezvous_env() -> None:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* from the deepspeed launcher, SLURM, or a lone process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # deepspeed / torchrun launcher
        env.setdefault("LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            raise RuntimeError(
                "RANK and WORLD_SIZE are set but MASTER_PORT is not; set it for the rendezvous"
            )
        env.update(_deepspeed_launcher_extras(env))
        return
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun without a launcher
        # The same mapping and rendezvous defaults as slurm/slurm_rank.sh (pretrain/distributed/cluster.py).
        env.update(slurm_task_env(env))
        return
    # A plain single process (tests, small jobs): a world of one.
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))


def _deepspeed_launcher_extras(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """What DeepSpeed's own launcher gives each rank beyond torch's variables, from the ones torch's elastic agent
    sets (LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE): DeepSpeed's CPU all-reduce reads LOCAL_SIZE to use shared
    memory; CROSS_RANK / CROSS_SIZE say which node. A value already set (DeepSpeed's launcher) wins."""
    pairs = (("LOCAL_SIZE", "LOCAL_WORLD_SIZE"), ("CROSS_RANK", "GROUP_RANK"), ("CROSS_SIZE", "GROUP_WORLD_SIZE"))
    return {ours: env[torchs] for ours, torchs in pairs if ours not in env and torchs in env}


SHM_DIR = Path("/dev/shm")


def cpu_shm_segment(rank: int) -> Path:
    """The shared-memory file DeepSpeed 0.19.8's CPU all-reduce (shm.cpp) creates for `rank` of this job."""
    env = os.environ
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_{rank}"


def _release_cpu_shm_names(rank: int, world_size: int) -> None:
    """Unlink this rank's CPU all-reduce segment once every rank has mapped every segment.

    DeepSpeed's shm.cpp creates one ~66 MiB segment per rank and never unlinks it, so every CPU job
    left them in /dev/shm (RAM) for good: hundreds of test launches filled a 24 GB machine. Its
    initialization returns only after a rank has mapped every other rank's segment, so after a
    barrier the names can go; the mappings live on until the processes exit. A world of one creates
    its segment too (and maps no other), so it unlinks at once.
    """
    if world_size > 1:
        dist.barrier()  # on every rank alike (whether a segment exists is not for each rank to decide)
    cpu_shm_segment(rank).unlink(missing_ok=True)


def process_group_backend(device_name: str, communication_backend: str) -> str:
    """The torch.distributed backend for the accelerator DeepSpeed uses, not for the hardware present.

    `--cpu` (DS_ACCELERATOR=cpu) on a machine with GPUs keeps every tensor on the CPU, which NCCL
    cannot reduce, so the choice follows the accelerator: cpu -> gloo (DeepSpeed's shared-memory
    all-reduce sits on top of it), cuda -> nccl, anything else -> that accelerator's own backend.
    """
    if device_name == "cpu":
        return "gloo"
    if device_name == "cuda":
        return "nccl"
    return communication_backend


def _join_on_own_store(backend: str, local_rank: int, timeout: timedelta) -> None:
    """The default process group, on a store whose server listens only where the ranks reach it
    (pretrain/distributed/rank_store.py: torch's env:// server listens on every interface). Where that keeps torch's
    env:// (the ranks of a torchrun sharing its agent's store), nothing here: DeepSpeed joins through env://. As
    DeepSpeed would, a CUDA rank of a world of several binds its device (`device_id`)."""
    store = rank_store_from_env(timeout)
    if store is None:
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = {"device_id": torch.device("cuda", local_rank)} if backend == "nccl" and world_size != 1 else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **device)


def init_distributed(timeout_minutes: int = DEFAULT_TIMEOUT_MINUTES) -> DistInfo:
    """Join (or create) the default process group; idempotent (a second call keeps the first timeout).

    The backend follows the accelerator (process_group_backend); collectives wait up to
    `timeout_minutes` for a busy peer (run.dist_timeout_minutes says why its default is long). LOCAL_RANK is rewritten to the
    device index (device_index, pretrain/distributed/cluster.py) before DeepSpeed reads it to bind the device.
    """
    accelerator = get_accelerator()
    if not dist.is_initialized():
        _fill_rendezvous_env()
        local = device_index(int(os.environ["LOCAL_RANK"]), os.environ.get("CUDA_VISIBLE_DEVICES"))
        os.environ["LOCAL_RANK"] = str(local)
        backend = process_group_backend(accelerator.device_name(), accelerator.communication_backend_name())
        signum = parent_death_signal()
        if signum is not None:
            # A rank ends with its launcher, even one SIGKILLed (launch.sh's watchdog stops the launcher's whole
            # group; this covers the launcher alone dying): PARENT_DEATH_SIGNALS says how.
            die_with_parent(signum)
        timeout = timedelta(minutes=timeout_minutes)
        _join_on_own_store(backend, local, timeout)
        # The CPU communication op is compiled here on a machine's first launch: said, and no stale lock waited on.
        with reporting_builds():  # DeepSpeed wraps the group joined above (torch's env:// where that kept it)
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
        if accelerator.device_name() == "cpu":
            _release_cpu_shm_names(dist.get_rank(), dist.get_world_size())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() == "cpu":
        device = torch.device("cpu")
    else:
        accelerator.set_device(local_rank)
        device = torch.device(accelerator.device_name(local_rank))
    return DistInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device
    )
