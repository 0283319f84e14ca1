"""One discovery round against real sources: dnsmasq on loopback (A and AAAA records, NXDOMAIN,
a name without addresses, a server that does not answer), the system resolver, and files."""

from __future__ import annotations

import os
import socket

import pytest

from dns_server import DnsServer
from kvroute.fleet.discovery import parse_source
from kvroute.fleet.discovery_lookup import MAX_FILE_BYTES, DiscoveryError, lookup


@pytest.fixture
async def dns_server(tmp_path):
    server = await DnsServer.start(tmp_path / "dns", {"replicas.test": ["127.0.0.2", "127.0.0.3", "fd00::7"]})
    yield server
    server.close()


async def test_every_a_and_aaaa_record_is_a_replica(dns_server):
    source = parse_source(f"dns://replicas.test:8123?server={dns_server.address}")
    assert await lookup(source, timeout_s=2.0) == {
        "http://127.0.0.2:8123", "http://127.0.0.3:8123", "http://[fd00::7]:8123"}
    await dns_server.set_records({"replicas.test": ["127.0.0.4"]})
    assert await lookup(source, timeout_s=2.0) == {"http://127.0.0.4:8123"}


async def test_a_name_without_addresses_answers_empty_and_a_missing_name_fails(dns_server):
    empty = parse_source(f"dns://empty.test:8000?server={dns_server.address}")
    assert await lookup(empty, timeout_s=2.0) == frozenset()
    missing = parse_source(f"dns://missing.test:8000?server={dns_server.address}")
    with pytest.raises(DiscoveryError, match=r"missing\.test at 127\.0\.0\.1:\d+: no such name \(NXDOMAIN\)"):
        await lookup(missing, timeout_s=2.0)
    # dnsmasq refuses names outside its zone (no upstream): a server failure, not an empty answer.
    with pytest.raises(DiscoveryError, match="REFUSED"):
        await lookup(parse_source(f"dns://other.example:8000?server={dns_server.address}"), timeout_s=2.0)


async def test_a_server_that_does_not_answer_times_out():
    # A UDP socket that reads nothing: the queries are never answered.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        port = silent.getsockname()[1]
        with pytest.raises(DiscoveryError, match=r"no answer within 0\.3 s"):
            await lookup(parse_source(f"dns://replicas.test:8000?server=127.0.0.1:{port}"), timeout_s=0.3)


async def test_without_a_server_the_system_resolver_answers():
    found = await lookup(parse_source("dns://localhost:8000"), timeout_s=5.0)
    assert "http://127.0.0.1:8000" in found
    assert await lookup(parse_source("dns://127.0.0.9:8000"), timeout_s=5.0) == {"http://127.0.0.9:8000"}
    with pytest.raises(DiscoveryError, match=r"^nothing\.invalid: "):
        await lookup(parse_source("dns://nothing.invalid:8000"), timeout_s=5.0)


async def test_a_file_is_read_whole_each_round(tmp_path):
    path = tmp_path / "workers"
    source = parse_source(f"file://{path}")
    with pytest.raises(DiscoveryError, match=r"cannot read .*No such file"):
        await lookup(source, timeout_s=1.0)
    path.write_text("http://127.0.0.2:8000\n")
    assert await lookup(source, timeout_s=1.0) == {"http://127.0.0.2:8000"}
    # Replaced by a rename (as Kubernetes updates a mounted ConfigMap), same size and mtime.
    stat = path.stat()
    new = tmp_path / "workers.new"
    new.write_text("http://127.0.0.3:8000\n")
    os.utime(new, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(new, path)
    assert await lookup(source, timeout_s=1.0) == {"http://127.0.0.3:8000"}
    path.write_text("http://127.0.0.2:8000\nnot a url\n")
    with pytest.raises(DiscoveryError, match="line 2: 'not a url'"):
        await lookup(source, timeout_s=1.0)
    path.write_bytes(b"http://127.0.0.2:8000 \xff\n")
    with pytest.raises(DiscoveryError, match="not UTF-8"):
        await lookup(source, timeout_s=1.0)
    path.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(DiscoveryError, match="larger than"):
        await lookup(source, timeout_s=1.0)
    with pytest.raises(DiscoveryError, match="cannot read"):
        await lookup(parse_source(f"file://{tmp_path}"), timeout_s=1.0)


async def test_a_relative_file_path_is_read_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "workers.json").write_text('[{"targets": ["127.0.0.5:9000"]}]')
    assert await lookup(parse_source("file://workers.json"), timeout_s=1.0) == {"http://127.0.0.5:9000"}
