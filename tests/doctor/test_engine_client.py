"""The HTTP client doctor and canary share reads whole bodies, however the engine chunks them."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from kvroute.engine_client.http import request
from kvroute.prometheus_text import parse_exposition

# A vLLM-like exposition, long enough to arrive in several chunks.
EXPOSITION = "".join(
    f'# HELP vllm:request_success_{i} done\n# TYPE vllm:request_success_{i} counter\n'
    f'vllm:request_success_{i}_total{{engine="0",model_name="m"}} {i}.0\n'
    for i in range(400)
).encode()


async def test_a_body_sent_in_pieces_is_read_whole(http: aiohttp.ClientSession) -> None:
    async def metrics(request_: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/plain"})
        await resp.prepare(request_)
        for start in range(0, len(EXPOSITION), 4096):  # cut mid-line, with pauses between pieces
            await resp.write(EXPOSITION[start:start + 4096])
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        reply = await request(http, "GET", f"http://127.0.0.1:{port}/metrics", timeout_s=10)
        assert reply.status == 200 and reply.body == EXPOSITION
        assert len(parse_exposition(reply.body.decode())) == 400
    finally:
        await runner.cleanup()
