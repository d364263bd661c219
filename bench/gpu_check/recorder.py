"""The check's file and its rows' outcomes: one JSON line per record, written (flushed, fsynced, never cut by a part's
stop) before its markdown row is printed, so that a crash or the time limit keeps every row measured before it;
one measurement that raises is a "failed" row and the check goes on."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu_check.budget import alarm_deferred


def one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:240]


class Recorder:
    """Appends one JSON line per record (flushed and fsynced) before its markdown row is printed."""

    def __init__(self, path: Path) -> None:
        self.path, self.run = path, time.strftime("%Y-%m-%dT%H:%M:%S")
        self.failed = self.rows = self.skipped = self.stopped = 0
        self.records: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self, kind: str, record: dict[str, Any], markdown: str | None = None) -> None:
        record = {"kind": kind, "run": self.run, **record}
        with alarm_deferred(), self.path.open("a", encoding="utf-8") as out:  # a part's stop never cuts a line
            out.write(json.dumps(record) + "\n")
            out.flush()
            os.fsync(out.fileno())
        self.records.append(record)
        if kind in ("train", "lamb", "attention", "selftest"):
            self.rows += 1
            self.skipped += record.get("status") == "skipped"
            self.stopped += record.get("status") == "stopped"
            # an attention check fails where no flash kernel ran on the GPU or the paths disagree; a self-test on FAIL
            self.failed += record.get("status") == "failed" or False in (record.get("flash_ran"), record.get("agree")) \
                or record.get("verdict") == "FAIL"
        if markdown is not None:
            print(markdown, flush=True)


def measure(key: dict[str, Any], fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """One measurement, DeepSpeed's prints sent to stderr; one that raises (out of memory, no compiler
    for the fused step, an impossible shape, ...) is a "failed" row and the check goes on."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return {**fn(*args), "status": "ok"}
    except Exception as error:  # noqa: BLE001 - a failed row is a result
        print(f"[gpu_check] {key} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return {**key, "status": "failed", "reason": one_line(error)}
