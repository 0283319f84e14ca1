"""One round of a discovery source (docs/discovery.md): resolve the DNS name or read the file.

``lookup`` returns the worker URLs the source gives now, or raises ``DiscoveryError``; what the
router makes of it is decided in ``fleet/discovery.py``.

DNS goes through the system resolver (``getaddrinfo``: /etc/hosts, search domains, the cluster's
DNS as the pod sees it) unless the source names a server (``?server=IP:PORT``), which dnspython
asks directly for A and AAAA records.  A file is read whole each round: it is small, and nothing
then depends on modification times (coarse on some filesystems) or on the file being the same
inode (an atomic rename replaces it; Kubernetes updates a mounted ConfigMap that way).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from kvroute.fleet.discovery import DiscoverySource, address_url, parse_targets

# A discovery file larger than this is a mistake (a log file named by accident), not a fleet.
MAX_FILE_BYTES = 1 << 20


class DiscoveryError(Exception):
    """A round gave no answer: the name does not exist or did not resolve in time, the server
    failed, the file is missing, unreadable or malformed.  The message says which."""


async def lookup(source: DiscoverySource, *, timeout_s: float) -> frozenset[str]:
    """The worker URLs ``source`` gives now (possibly none); raises ``DiscoveryError``."""
    if source.kind == "file":
        return await asyncio.to_thread(read_targets, Path(source.path))
    if source.server is None:
        addresses = await _system_addresses(source.host, source.port, timeout_s)
    else:
        addresses = await _server_addresses(source.host, source.server, timeout_s)
    return frozenset(address_url(a, source.port) for a in addresses)


def read_targets(path: Path) -> frozenset[str]:
    """The worker URLs a discovery file lists (``parse_targets``); raises ``DiscoveryError``."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise DiscoveryError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise DiscoveryError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        return parse_targets(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise DiscoveryError(f"{path} is not UTF-8 text") from None
    except ValueError as exc:
        raise DiscoveryError(f"{path}: {exc}") from None


async def _system_addresses(host: str, port: int, timeout_s: float) -> set[str]:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except TimeoutError:
        raise DiscoveryError(f"{host}: no answer from the system resolver within {timeout_s:g} s") from None
    except socket.gaierror as exc:
        raise DiscoveryError(f"{host}: {exc.strerror}") from None
    return {str(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}


async def _server_addresses(host: str, server: tuple[str, int], timeout_s: float) -> set[str]:
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [server[0]]
    resolver.port = server[1]
    resolver.lifetime = timeout_s
    where = f"{host} at {server[0]}:{server[1]}"
    try:
        answers = await asyncio.gather(
            *(resolver.resolve(host, kind, search=False, raise_on_no_answer=False)
              for kind in (dns.rdatatype.A, dns.rdatatype.AAAA)))
    except dns.resolver.NXDOMAIN:
        raise DiscoveryError(f"{where}: no such name (NXDOMAIN)") from None
    except dns.resolver.LifetimeTimeout:
        raise DiscoveryError(f"{where}: no answer within {timeout_s:g} s") from None
    except dns.exception.DNSException as exc:
        raise DiscoveryError(f"{where}: {exc}") from None
    return {rdata.address for answer in answers if answer.rrset is not None for rdata in answer.rrset}
