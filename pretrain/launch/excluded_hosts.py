"""The hosts a SLURM job dropped, kept in its run folder so that its requeue starts no agent there.

A host that leaves the job (pretrain/launch/bad_nodes.py: a bad or slow node; survivors.py: a rank SIGKILL cannot
end) is written to RUN/logs/excluded_hosts.json with the SLURM job id and why. When SLURM runs the same job again (a
requeue: the same job id, perhaps on the same nodes), pretrain/launch/nodes.py leaves those hosts out of the agents'
step (`srun --exclude`) and says so in one line. A new job (another id) starts from its whole allocation: the host
may have been mended, and SLURM's own drain is the lasting word on a node.

nodes.py finds the run folder the way the driver will (the config's `run.dir`, an override `--run.dir` winning),
with the standard library only, as nodes.py itself is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from pretrain.config.sections import RunSection
from pretrain.distributed.cluster import ClusterError, allocation_hosts
from pretrain.run_folder import excluded_hosts_path


def run_dir_of(module_args: Sequence[str]) -> Path | None:
    """The run folder the driver's arguments name (`--config RUN.json`, `--run.dir=...`); None when they cannot be
    read here (the ranks will say why in their own line)."""
    args = list(module_args)
    run_dir: str | None = None
    config: str | None = None
    for i, arg in enumerate(args):
        for name in ("--config", "--run.dir"):
            if arg == name and i + 1 < len(args):
                value: str | None = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.partition("=")[2]
            else:
                continue
            config, run_dir = (value, run_dir) if name == "--config" else (config, value)
    if run_dir is None and config is not None:
        try:
            section = json.loads(Path(config).read_text(encoding="utf-8")).get("run", {})
            run_dir = section.get("dir") if isinstance(section, dict) else None
        except (OSError, ValueError, AttributeError):
            return None
    return Path(run_dir if isinstance(run_dir, str) else RunSection().dir)


def excluded(run_dir: Path | None, job_id: str) -> dict[str, str]:
    """Host -> why, for the hosts SLURM job `job_id` dropped before (none for another job or an unreadable file)."""
    if run_dir is None or not job_id:
        return {}
    try:
        state = json.loads(excluded_hosts_path(run_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    hosts = state.get("hosts") if isinstance(state, dict) and state.get("slurm_job") == job_id else None
    return {str(host): str(why) for host, why in hosts.items()} if isinstance(hosts, dict) else {}


def exclude(run_dir: Path | None, job_id: str, host: str, why: str) -> None:
    """Add `host` to job `job_id`'s excluded hosts (written whole, then renamed: a reader never sees half of it). A
    folder that cannot take it costs the exclusion only."""
    if run_dir is None or not job_id:
        return
    hosts = {**excluded(run_dir, job_id), host: why}
    path = excluded_hosts_path(run_dir)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"slurm_job": job_id, "hosts": hosts}, indent=1), encoding="utf-8")
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)


def slurm_hosts(count: int, least: int, left_out: dict[str, str]) -> tuple[list[str], str]:
    """The first `count` nodes of this SLURM allocation, as srun names them (scontrol expands the list), without
    those this job dropped before (`left_out`, host -> why), and the warning line that names them; ClusterError when
    fewer than `least` (--nodes MIN) are left."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    if not nodelist:
        raise ClusterError("--slurm: SLURM_JOB_NODELIST is unset (not inside an allocation)")
    job = os.environ.get("SLURM_JOB_ID", "?")
    every = allocation_hosts(nodelist, scontrol=True)
    hosts = [host for host in every if host not in left_out]
    named = "; ".join(f"{host} ({why})" for host, why in left_out.items() if host in every)
    if len(hosts) < (least if named else count):
        raise ClusterError(f"--nodes {count} but SLURM job {job} has {len(hosts)}"
                           + (f" without the node(s) it dropped before: {named}" if named else ""))
    note = (f"warning: node(s) left out, this job (SLURM job {job}) dropped them before: {named}; starting on "
            f"{min(count, len(hosts))}") if named else ""
    return hosts[:count], note
