"""The c10d rendezvous store of a multi-node job, in a process of its own on a machine that outlives the nodes.

    python -m pretrain.launch.store --port P          serve on port P until stopped (SIGTERM, SIGINT)

pretrain/launch/nodes.py runs it on the machine that runs launch.sh (pretrain/launch/rendezvous.py says why),
handing it the socket it already bound (`--listen-fd`); it ends with nodes.py (parent-death signal) and nodes.py
notices at once when it ends first. Run it by hand on a machine of your choice, then launch with
`--rdzv-endpoint THAT_HOST:P`: one store may serve any number of jobs (each meets under its own run id).
It needs torch (its TCPStore); nodes.py, which starts it, does not.
"""

from __future__ import annotations

import argparse
import signal
import sys
from datetime import timedelta

from torch.distributed import TCPStore

from pretrain.distributed.lifetime import die_with_parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.store", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, default=None, help="a socket already listening on the port")
    parser.add_argument("--with-parent", action="store_true", help="end when the process that started it ends")
    args = parser.parse_args(argv)
    if args.with_parent:
        die_with_parent(signal.SIGTERM)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit(0))
    try:
        store = TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=timedelta(seconds=60), master_listen_fd=args.listen_fd)
    except (RuntimeError, OSError) as err:
        print(f"launch.sh: error: the rendezvous store cannot serve port {args.port}: {err}", file=sys.stderr)
        return 2
    print(f"rendezvous store: serving port {store.port}", flush=True)
    while True:  # the store serves from its own threads until a signal ends this process
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
