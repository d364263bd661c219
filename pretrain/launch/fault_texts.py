"""What a failed rank's log says, read as torch writes it: its last report (the last traceback, or the C++
`terminate called ...` of a thread that aborted the process), the exception that report names, and whether the rank
died of another's failure (a victim) or of its own.

Why the whole report and not one line: torch writes a peer's death over several lines. An NCCL error raised in the
rank's own thread is `NCCL error in: FILE:LINE, <reason>, NCCL version X`, a newline, then the detail of the error
code (torch/csrc/distributed/c10d/NCCLUtils.cpp, C10D_NCCL_CHECK and getNcclErrorDetailStr), for example

    torch.distributed.DistBackendError: NCCL error in: .../NCCLUtils.cpp:77, remote process exited or there was a
        network error, NCCL version 2.26.2
    ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.
    Last error:
    socketPollConnect: connect returned Connection refused, exceeded error retry count (35)

(each line behind torch's `[rankN]: `). The last line shaped like an exception there is `ncclRemoteError: ...`,
and what says "a peer is gone" may be on any of the four. So a victim is told from every line of the report's
message, and the exception that keys "the same failure again" is the report's first, the one Python raised.

The texts, and where torch (2.13) writes each (tests/launch/fixtures/fault_texts/ holds them as a rank's log holds
them, captured from real gloo ranks whose peer was SIGKILLed, and, for NCCL, built from torch's format strings):
gloo's pair.cc "Connection closed by peer" / "Connection reset by peer"; the ranks' TCPStore when the rank serving
it is gone ("Failed to recv, got 0 bytes", "Broken pipe", "Connection reset by peer"), when a rank never joins it
("Timed out after N seconds waiting for clients", "wait timeout after N ms, keys: ..."); NCCL's
ncclGetErrorString ("remote process exited or there was a network error") and its detail ("ncclRemoteError: ...
a remote process exiting prematurely", or for an older NCCL's ncclSystemError "It can be also caused by unexpected
exit of a remote peer"), NCCL's last error "Connection closed by remote peer";
ProcessGroupNCCL's watchdog ("Watchdog caught collective operation timeout", "NCCL communicator was aborted").
Not DistBackendError, DistNetworkError or ncclSystemError as such: a rank whose own GPU or NIC fails (an Xid, a
CUDA error, "NET/IB: ... error") or whose port is taken (DistNetworkError "The server socket has failed to
listen") raises them too, and is the culprit; nor a client's "The client socket has timed out after" (the store's
host gone, or this node's own link: the store's host, when it failed, is the more telling record anyway).

Standard library only: the ground floor (pretrain/launch/faults.py reads the driver's own error lines).
"""

from __future__ import annotations

import re
from pathlib import Path

_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*")
TAIL_BYTES = 1 << 20  # what is read of a rank's log: its end, where a failure's last report is
TRACEBACK = "Traceback (most recent call last):"
TERMINATE = "terminate called after throwing"  # a C++ exception out of a thread: std::terminate, then SIGABRT
VICTIM_TEXTS = (
    # gloo (third_party/gloo/gloo/transport/tcp/pair.cc), and a socket the peer's death closed
    "Connection closed by peer", "Connection reset by peer", "ConnectionResetError", "Broken pipe",
    "BrokenPipeError",
    # the ranks' TCPStore (torch/csrc/distributed/c10d/TCPStore*.cpp, Utils.hpp): its server gone, a rank missing
    "Failed to recv, got 0 bytes", "Did the remote server shutdown or crash", "waiting for clients",
    "wait timeout after",
    # NCCL (ncclGetErrorString; torch's getNcclErrorDetailStr; NCCL's own last error)
    "remote process exited", "remote process exiting prematurely", "unexpected exit of a remote peer",
    "Connection closed by remote peer",
    # ProcessGroupNCCL's watchdog: a collective a peer never joined, a communicator aborted for another's failure
    "Watchdog caught collective operation timeout", "watchdog timeout", "NCCL communicator was aborted",
)
# What says a rank's own device failed (a CUDA error of its own, reported by NCCL's watchdog thread as it aborts
# the process): a SIGABRT with these words, and no victim's, is the culprit's.
# A full file system or a spent quota (ENOSPC 28, EDQUOT 122 on Linux), in Python's words or Rust's (safetensors):
# the one failure that a restart cannot mend and freeing space does.
_SPACE = re.compile(r"\[Errno (?:28|122)\]|\(os error (?:28|122)\)|No space left on device|Disk quota exceeded")
OWN_DEVICE_TEXTS = ("CUDA error:", "ncclUnhandledCudaError", "unhandled cuda error")


def log_lines(log: Path) -> list[str]:
    """The end of the rank's log (its last TAIL_BYTES: a failure's last words, however much the rank logged before),
    each line without the `[rankN]: ` torch puts before the lines of an uncaught exception (torch.distributed's
    excepthook, distributed_c10d.py)."""
    try:
        with log.open("rb") as stream:
            stream.seek(max(0, stream.seek(0, 2) - TAIL_BYTES))
            text = stream.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [_RANK_PREFIX.sub("", line, count=1) for line in text.splitlines()]


def last_report(lines: list[str]) -> tuple[str | None, list[str]]:
    """The rank's last words on its failure: (the exception the last traceback names, every line of its message
    and what follows it), or for a C++ abort (the `what():` line, what follows). A log with neither: (the last line
    shaped like an exception, the lines from there on). Frames and source lines (indented) are left out: a frame's
    code could hold any text."""
    starts = [i for i, line in enumerate(lines) if line.strip() == TRACEBACK or line.startswith(TERMINATE)]
    if starts and lines[starts[-1]].startswith(TERMINATE):
        rest = lines[starts[-1]:]
        what = next((line.strip() for line in rest if line.strip().startswith("what():")), rest[0].strip())
        return what[:200], rest
    if starts:
        body = lines[starts[-1] + 1:]
        first = next((i for i, line in enumerate(body) if line and not line[0].isspace()), None)
        if first is not None:
            return body[first].strip()[:200], body[first:]
        return None, []
    found = next((i for i in range(len(lines) - 1, -1, -1) if _EXCEPTION.match(lines[i].strip())), None)
    return (lines[found].strip()[:200], lines[found:]) if found is not None else (None, [])


def out_of_space(text: str | None) -> bool:
    """Whether a rank's error line says its file system is full or its quota spent."""
    return bool(text and _SPACE.search(text))


def exception_line(log: Path) -> str | None:
    """The exception a rank's last traceback names ("RuntimeError: ..."; for NCCL the `DistBackendError: NCCL
    error in: ...` line, not the detail after it): what tells two failures at one step apart."""
    return last_report(log_lines(log))[0]


def is_victim(report: list[str]) -> bool:
    """Whether a rank died of another's failure: some line of its last report says a peer is gone (VICTIM_TEXTS).
    An empty report (nothing in its log) is not a victim: nothing says a peer is gone, and a victim's record never
    stops the restarts, so one with no evidence must still be able to."""
    return any(text in line for line in report for text in VICTIM_TEXTS)


def victim_log(log: Path) -> bool:
    """is_victim on the last report of a rank's log."""
    return is_victim(last_report(log_lines(log))[1])


def own_device_error(log: Path) -> bool:
    """Whether a rank's last report names its own device's failure (a CUDA error) and no lost peer: a SIGABRT that
    is the culprit's, NCCL's watchdog having aborted it for its own GPU."""
    report = last_report(log_lines(log))[1]
    return not is_victim(report) and any(text in line for line in report for text in OWN_DEVICE_TEXTS)
