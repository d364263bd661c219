"""The names inside a run folder (`run.dir`), in one place: the driver, the metrics writer, the run clock,
the job lock, the exports, codistillation's exchange and the report write them; the run records, the
report, the model card and the demo read them. docs/pretraining.md's "What a run folder holds" lists
exactly these (tests/report/test_run_folder.py compares, and checks that no other module spells them).
Standard library only: every floor may import it.

The checkpoint folder inside (CHECKPOINTS, or `checkpoint.dir`) has its own layout:
pretrain/checkpointing/layout.py. These names are what existing run folders hold: renaming one makes
the reports and resumes of older runs miss it.
"""

from __future__ import annotations

from pathlib import Path

RESOLVED_CONFIG = "config.resolved.json"  # the config after overrides + what was derived (pretrain/train.py)
CLOCK_FILE = "run_clock.json"  # wall-clock, device-hours and stops across resumes (pretrain/metrics/clock.py)
JOB_LOCK = ".job.lock"  # held by rank 0 for the job's life (pretrain/distributed/lifetime.py)
CHECKPOINTS = "checkpoints"  # the checkpoint folder unless checkpoint.dir says otherwise
EXPORT = "export"  # EXPORT/<phase>: a Hugging Face folder per phase end (pretrain/checkpointing/export.py)
EXPORT_INFO = "export_info.json"  # inside each export folder: where it came from (pretrain/checkpointing/export.py)
TENSORBOARD = "tensorboard"  # event files and METRICS_FILE (pretrain/metrics/writer.py)
METRICS_FILE = "metrics.jsonl"  # one JSON line per logged step, inside TENSORBOARD
EXCHANGE = "exchange"  # codistillation's filesystem exchange, unless codistill.exchange_dir says otherwise
REPORT_MD = "report.md"  # `./launch.sh report RUN_DIR` (pretrain/report/write.py)
REPORT_PNG = "report.png"
SHARDS_VERIFIED = "shards_verified.json"  # inside LOGS: the launch that hashed every shard last (pretrain/plan/run_plan.py)
LOGS = "logs"  # LOGS/<launch time>[-node]/attempt-K/rank-R.log and agent.log (pretrain/launch/agent.py)
DEVICE_CHECKS = "device_checks"  # inside LOGS: each host's self-test verdict, <host>.json (pretrain/device_check/host_check.py)
FAULTS = "faults"  # inside LOGS: one JSON record per fault the agents judged, every node's (pretrain/launch/faults.py)
EXCLUDED_HOSTS = "excluded_hosts.json"  # inside LOGS: hosts a SLURM job dropped, left out when it is requeued

# What docs/pretraining.md lists, as paths inside the run folder (a folder ends with "/").
LISTED = (RESOLVED_CONFIG, CLOCK_FILE, JOB_LOCK, f"{CHECKPOINTS}/", f"{EXPORT}/", f"{EXPORT}/<phase>/{EXPORT_INFO}",
          f"{TENSORBOARD}/", f"{TENSORBOARD}/{METRICS_FILE}", f"{EXCHANGE}/", REPORT_MD, REPORT_PNG, f"{LOGS}/",
          f"{LOGS}/{FAULTS}/", f"{LOGS}/{SHARDS_VERIFIED}", f"{LOGS}/{EXCLUDED_HOSTS}", f"{LOGS}/{DEVICE_CHECKS}/")


def metrics_path(run_dir: Path) -> Path:
    return Path(run_dir) / TENSORBOARD / METRICS_FILE


def export_dir(run_dir: Path, phase: str) -> Path:
    return Path(run_dir) / EXPORT / phase


def launch_logs_dir(run_dir: Path, launch: str) -> Path:
    """The folder of one launch's logs (`launch`: its start time, plus the node with a hostfile)."""
    return Path(run_dir) / LOGS / launch


def shards_verified_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOGS / SHARDS_VERIFIED


def faults_dir(run_dir: Path) -> Path:
    """The fault records of every launch, attempt and node: the nodes share the run folder, so they judge "the same
    failure again" together, and a report reads what the faults cost from here."""
    return Path(run_dir) / LOGS / FAULTS


def device_check_path(run_dir: Path, host: str) -> Path:
    """Host `host`'s cached self-test verdict; the name keeps letters, digits, '.', '-' and '_' of the host's (one
    file per host, never a path out of the folder)."""
    name = "".join(c if c.isalnum() or c in ".-_" else "_" for c in host).lstrip(".") or "_"
    return Path(run_dir) / LOGS / DEVICE_CHECKS / f"{name}.json"


def excluded_hosts_path(run_dir: Path) -> Path:
    """The hosts a SLURM job dropped (pretrain/launch/excluded_hosts.py): its requeue starts no agent there."""
    return Path(run_dir) / LOGS / EXCLUDED_HOSTS
