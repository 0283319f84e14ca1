"""A real DNS server on loopback for discovery tests: Debian's dnsmasq, unprivileged, on a free
port, answering only for names under ``.test`` from a hosts file the test rewrites.

``await DnsServer.start(tmp_path)``, then ``await server.set_records({"replicas.test": [...]})``:
the file is rewritten, dnsmasq re-reads it on SIGHUP, and the call returns once dnsmasq answers
with the new records.  The names in ``names_without_addresses`` (``empty.test`` by default)
always exist with a TXT record: without addresses in the file they answer NOERROR with no A/AAAA
record; other names under ``.test`` are NXDOMAIN.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver
import pytest

DNSMASQ = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")


def require_dnsmasq() -> str:
    """dnsmasq's path, or skip the test saying how to get it."""
    if DNSMASQ is None:
        pytest.skip("dnsmasq is not installed (apt-get install dnsmasq-base; .ci/run installs it)")
    return DNSMASQ


class DnsServer:
    """One dnsmasq process; ``address`` is ``127.0.0.1:PORT`` for ``?server=``."""

    def __init__(self, directory: Path, process: subprocess.Popen[bytes], port: int,
                 names_without_addresses: Sequence[str]) -> None:
        self.hosts = directory / "hosts"
        self.log = directory / "dnsmasq.log"
        self.process = process
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.names_without_addresses = names_without_addresses

    @classmethod
    async def start(cls, directory: Path, records: Mapping[str, Sequence[str]] | None = None, *,
                    names_without_addresses: Sequence[str] = ("empty.test",)) -> DnsServer:
        """Start dnsmasq on a free UDP/TCP port of 127.0.0.1 serving ``records`` (name -> addresses)."""
        binary = require_dnsmasq()
        directory.mkdir(parents=True, exist_ok=True)
        hosts = directory / "hosts"
        hosts.write_text(_hosts_text(records or {}))
        for _ in range(5):
            port = _free_port()
            log = (directory / "dnsmasq.log").open("wb")
            process = subprocess.Popen(
                [binary, "--keep-in-foreground", "--conf-file=/dev/null", f"--port={port}",
                 "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
                 f"--addn-hosts={hosts}", "--local=/test/",
                 *(f"--txt-record={name},no-address" for name in names_without_addresses),
                 # As root it would switch to "nobody", who cannot read the test's files.
                 "--pid-file=", *(["--user=root"] if os.geteuid() == 0 else []), "--log-facility=-"],
                stdout=log, stderr=subprocess.STDOUT)
            log.close()
            server = cls(directory, process, port, names_without_addresses)
            if await server._answers():
                return server
            server.close()
        raise RuntimeError(f"dnsmasq did not start: {(directory / 'dnsmasq.log').read_text()[-2000:]}")

    async def set_records(self, records: Mapping[str, Sequence[str]]) -> None:
        """Serve ``records`` from now on (names absent from it become NXDOMAIN)."""
        tmp = self.hosts.with_suffix(".new")
        tmp.write_text(_hosts_text(records))
        os.replace(tmp, self.hosts)
        self.process.send_signal(signal.SIGHUP)
        # A name given no address is absent from the file: NXDOMAIN, unless it has its TXT record.
        want = {name: set(addresses) or (set() if name in self.names_without_addresses else None)
                for name, addresses in records.items()}
        for _ in range(100):
            if {name: await self.addresses(name) for name in want} == want:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"dnsmasq did not take the new records: {self.log.read_text()[-2000:]}")

    async def addresses(self, name: str, *, timeout_s: float = 1.0) -> set[str] | None:
        """What dnsmasq answers for ``name`` now (A and AAAA), None for NXDOMAIN."""
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers, resolver.port, resolver.lifetime = ["127.0.0.1"], self.port, timeout_s
        found: set[str] = set()
        try:
            for kind in (dns.rdatatype.A, dns.rdatatype.AAAA):
                answer = await resolver.resolve(name, kind, raise_on_no_answer=False)
                found.update(r.address for r in answer.rrset or ())
        except dns.resolver.NXDOMAIN:
            return None
        return found

    async def _answers(self) -> bool:
        for _ in range(50):
            if self.process.poll() is not None:
                return False
            try:
                await self.addresses("empty.test", timeout_s=0.1)
                return True
            except dns.exception.DNSException:
                await asyncio.sleep(0.05)
        return False

    def close(self) -> None:
        """Stop dnsmasq."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def _hosts_text(records: Mapping[str, Sequence[str]]) -> str:
    return "".join(f"{address} {name}\n" for name, addresses in records.items() for address in addresses)


def _free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (dnsmasq binds both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
