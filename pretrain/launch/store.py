"""The c10d rendezvous store of a multi-node job, in a process of its own on a machine that outlives the nodes.

    python -m pretrain.launch.store --host ADDR --port P    serve at ADDR:P until stopped (SIGTERM, SIGINT)

pretrain/launch/nodes.py runs it on the machine that runs launch.sh (pretrain/launch/rendezvous.py says why),
handing it the socket it already bound to the address the nodes reach (`--listen-fd`); it ends with nodes.py
(parent-death signal) and nodes.py notices at once when it ends first. Run it by hand on a machine of your choice,
bound to the address the nodes reach it at (`--host`; never every interface), then launch with
`--rdzv-endpoint ADDR:P`. The store holds no secret and runs nothing it holds: the agents sign their states with
their job's own key (pretrain/launch/signed_rendezvous.py), so the store's users cannot forge one; but anyone who
reaches the port can delete or overwrite keys and so stall a rendezvous: docs/launching.md says whom to share it with.
It needs torch (its TCPStore); nodes.py, which starts it, does not.
"""

from __future__ import annotations

import argparse
import signal
import sys
from datetime import timedelta

from torch.distributed import TCPStore

from pretrain.distributed.cluster import ClusterError
from pretrain.distributed.lifetime import die_with_parent
from pretrain.launch.rendezvous import listen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.launch.store", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", required=True, help="the address the nodes reach this machine at (served there alone;"
                        " with --listen-fd the address that socket is bound to)")
    parser.add_argument("--listen-fd", type=int, default=None, help="a socket already listening on the port")
    parser.add_argument("--with-parent", action="store_true", help="end when the process that started it ends")
    args = parser.parse_args(argv)
    if args.with_parent:
        die_with_parent(signal.SIGTERM)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit(0))
    try:
        listen_fd = args.listen_fd if args.listen_fd is not None else listen(args.port, args.host).detach()
        store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                         multi_tenant=True, timeout=timedelta(seconds=60), master_listen_fd=listen_fd)
    except ClusterError as err:
        print(f"launch.sh: error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as err:
        print(f"launch.sh: error: the rendezvous store cannot serve port {args.port}: {err}", file=sys.stderr)
        return 2
    print(f"rendezvous store: serving port {store.port}", flush=True)
    while True:  # the store serves from its own threads until a signal ends this process
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
