"""Tidying OUT: temp files a killed task left, the work/ files of a finished build, and what the build says
about its NSP draws once the manifest is written (data_prep/build.py calls these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data_prep.work_layout import work_files, work_folders


def remove_stale_temp_files(out: Path) -> None:
    """Temp files a killed run left behind (atomic writes rename them when complete). Not done
    by nodes of a multi-node build: another node may be writing its own temp files right now."""
    for path in out.rglob(".*.tmp"):
        path.unlink(missing_ok=True)


def remove_work(out: Path, num_shards: int, seq_lens: tuple[int, ...], output_shards: dict[str, int]) -> None:
    """The intermediate files of a finished build (2-3x the output's size): only the names work_layout gives,
    so a file someone else put in work/ stays, and with it its folder. The manifest is written: a relaunch
    reports the folder complete without them."""
    for path in work_files(out, num_shards, seq_lens, output_shards):
        path.unlink(missing_ok=True)
    for folder in work_folders(out, seq_lens):
        try:
            folder.rmdir()
        except OSError:  # absent, or holds what the build did not write (work/slurm/, a user's file)
            pass


def report_self_draws(pools: dict[str, Any]) -> None:
    """Say so when a negative's B had to come from A's own document (a split of one document)."""
    for seq_len, by_split in pools["self_draws"].items():
        for split, count in by_split.items():
            if count:
                print(f"nsp: {count} random-next segment(s) of {split} at length {seq_len} come from A's own "
                      f"document: the {split} split has one document", flush=True)
