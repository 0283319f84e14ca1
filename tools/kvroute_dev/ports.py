"""Free loopback ports for the tests' and benchmarks' servers."""

from __future__ import annotations

import socket


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive TCP ports free on 127.0.0.1 now (a server with several
    listeners, or a data-parallel rank's KV-event ports at the base + rank).  Another process may
    still take one before it is bound: callers start over on a bind error."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free loopback ports")
