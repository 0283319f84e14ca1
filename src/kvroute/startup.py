"""What the commands say when they cannot start: one line on standard error, no traceback."""

from __future__ import annotations

import errno
import socket
from typing import NoReturn

import typer

_LISTEN_HINTS = {
    errno.EADDRINUSE: "address already in use (another process listens there: stop it, or choose "
                      "another --port)",
    errno.EACCES: "permission denied (ports below 1024 need privileges: choose another --port)",
    errno.EADDRNOTAVAIL: "this machine has no such address (check --host)",
}


def listen_error(where: str, exc: OSError) -> str:
    """Why listening on ``where`` (``host:port``) failed, in words a user can act on."""
    if isinstance(exc, socket.gaierror):
        return f"cannot listen on {where}: the host name does not resolve ({exc.strerror})"
    hint = _LISTEN_HINTS.get(exc.errno or 0)
    return f"cannot listen on {where}: {hint or exc.strerror or exc}"


def check_port_free(host: str, port: int) -> None:
    """Raise the OSError that listening on ``host:port`` would raise now (the port taken, the
    address not this machine's), so that a command fails before it starts anything else; the
    socket is closed at once (port 0 is not checked: any free port will do)."""
    if port == 0:
        return
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        # As asyncio's create_server does: a port whose old connections linger in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)


def host_port(host: str, port: int | str) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def fail(command: str, message: str, code: int = 2) -> NoReturn:
    """Print ``kvroute COMMAND: MESSAGE`` on standard error and exit with ``code`` (2: the
    command line or the configuration is wrong; 1: it could not run)."""
    typer.echo(f"kvroute {command}: {message}", err=True)
    raise typer.Exit(code)
