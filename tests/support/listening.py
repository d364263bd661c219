"""Which local addresses a port is listening on, read from the kernel's own tables: what another user on the
network can reach, whatever a library says it binds."""

from __future__ import annotations


def listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp and tcp6 write them) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append(address)
    return found
