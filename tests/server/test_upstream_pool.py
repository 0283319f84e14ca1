"""The router's pool of keep-alive connections to workers, against a raw HTTP server on loopback
that never closes a connection itself and counts those open (issue 24, item 6: idle upstream
connections stayed open after 90 s)."""

from __future__ import annotations

import asyncio

from kvroute.server.upstream import UpstreamPool

_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class _CountingServer(asyncio.Protocol):
    """Answers every request on a connection with a tiny 200 and keeps the connection open."""

    open = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        _CountingServer.open += 1

    def data_received(self, data: bytes) -> None:
        for _ in range(data.count(b"\r\n\r\n")):
            self.transport.write(_ANSWER)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        _CountingServer.open -= 1


async def _eventually(check, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


async def test_idle_upstream_connections_are_closed_after_the_keepalive_timeout():
    _CountingServer.open = 0
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_CountingServer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=600, keepalive_s=0.4, limit_per_origin=64)
    origin = pool.origin(url)
    try:
        async def one() -> None:
            call = await pool.send(origin, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            chunks: list[bytes] = []
            call.attach(chunks.append)
            await call.done
            assert b"".join(chunks) == b"ok"

        await asyncio.gather(*(one() for _ in range(12)))  # 12 at once: 12 connections
        assert pool.connection_count(url) == 12 and _CountingServer.open == 12
        # Used again within the keep-alive timeout: the pooled connections serve it.
        await asyncio.sleep(0.1)
        await one()
        assert _CountingServer.open == 12
        # Left idle: every one is closed by the router soon after the timeout (a quarter of it
        # late at most), though the server never closes one and no request comes to notice.
        await _eventually(lambda: _CountingServer.open == 0, timeout=0.4 + 0.1 + 2.0)
        assert pool.connection_count(url) == 0
        # The pool still works afterwards, on a new connection.
        await one()
        assert _CountingServer.open == 1
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
