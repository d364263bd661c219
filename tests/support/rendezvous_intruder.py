"""Someone else on the machine, during a real launch: a client of the job's rendezvous store who plants a pickle.

torch's TCPStore has no authentication, and `list_keys()` names the rendezvous key. The intruder waits for the store
of a one-machine launch to answer at its port, sets a pickle whose `__reduce__` writes `marker` into the rendezvous
key (before and after the agent's first state), then a forged "closed" state (a plain pickle of torch's own state).
Unsigned, none is read (pretrain/launch/signed_rendezvous.py): the marker never appears, the job is not ended, and the
agent says so in one line. tests/launch/test_faults.py hosts it in a launch it runs anyway (its reference run).
"""

from __future__ import annotations

import base64
import pickle
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from pretrain.launch.signed_rendezvous import KEY_PREFIX


class Planted:
    """Unpickling it writes the marker file: code run in whoever unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return Path.write_text, (self.marker, "ran in the agent")


class Intruder:
    """A thread that plants into the rendezvous store at 127.0.0.1:`port` while the launch runs (module docstring);
    `planted` counts the values it set."""

    def __init__(self, port: int, marker: Path, wait_s: float = 300.0) -> None:
        self.port, self.marker, self.wait_s = port, marker, wait_s
        self.planted = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Intruder:
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.done.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self._plant()
        except (RuntimeError, ValueError, TimeoutError):  # the store went with the job's end
            return

    def _plant(self) -> None:
        deadline = time.monotonic() + self.wait_s
        store, key = None, ""
        while not self.done.is_set() and time.monotonic() < deadline and not key:
            try:
                store = store or TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=2))
                key = next((k for k in store.list_keys() if k.startswith(KEY_PREFIX) and k.count(".") == 2), "")
            except (RuntimeError, ValueError, TimeoutError):  # not serving yet
                store = None
            if not key:
                time.sleep(0.1)
        if store is None or not key:
            return
        self._set(store, key, pickle.dumps(Planted(self.marker)))  # before or during the first rendezvous
        first = store.get(key)
        while not self.done.is_set() and store.get(key) == first:  # the agent's next write replaces it
            time.sleep(0.1)
        self._set(store, key, pickle.dumps(Planted(self.marker)))  # and with a good state held
        time.sleep(1.0)
        forged = _RendezvousState()
        forged.closed = True
        self._set(store, key, pickle.dumps(forged))

    def _set(self, store: TCPStore, key: str, state: bytes) -> None:
        if not self.done.is_set():
            store.set(key, base64.b64encode(state))
            self.planted += 1
