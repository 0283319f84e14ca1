"""Shutdown with requests still running when ``shutdown_timeout_s`` expires: every stream ends
with an error event in its API's format (no broken framing), every request not yet answered gets
503, the cut is logged and ``kvroute serve`` exits non-zero."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import orjson
from test_server_cli import SERVE, free_port

from kvroute_dev.raw_http import HEALTH, Conversation, connect, read
from kvroute_dev.raw_http import post as raw_post

STREAMS = {
    b"/v1/chat/completions": {"model": "echo", "stream": True,
                              "messages": [{"role": "user", "content": "a"}]},
    b"/v1/messages": {"model": "echo", "stream": True, "max_tokens": 9,
                      "messages": [{"role": "user", "content": "b"}]},
    b"/v1/responses": {"model": "echo", "stream": True, "input": "c"},
}


def _last_event(body: bytes) -> tuple[str | None, dict[str, object]]:
    assert body.endswith(b"\n\n"), body[-80:]
    block = body[:-2].rsplit(b"\n\n", 1)[-1]
    name = None
    data = b""
    for line in block.split(b"\n"):
        if line.startswith(b"event: "):
            name = line[7:].decode()
        elif line.startswith(b"data: "):
            data = line[6:]
    return name, orjson.loads(data)


async def test_streams_past_the_timeout_end_with_error_events_and_queued_requests_get_503(
        echo_engines, router):
    [engine] = await echo_engines(1, events=400, delay_s=0.05)  # 20 s streams
    r = await router([engine.url], shutdown_timeout_s=0.3)
    conns = []
    for path, doc in STREAMS.items():
        reader, writer = await connect(r.url)
        # A request pipelined behind the stream is queued on the connection.
        writer.write(raw_post(path, orjson.dumps(doc)) + (HEALTH if path == b"/v1/chat/completions" else b""))
        conv = Conversation()
        conv.feed(await asyncio.wait_for(reader.read(65536), 10))
        conns.append((path, reader, writer, conv))
    report = await r.close()
    assert (report.streams_ended, report.answered_503, report.truncated) == (3, 1, 0)
    for path, reader, writer, conv in conns:
        await read(reader, conv, timeout=10)
        writer.close()
        assert conv.closed
        stream = conv.answers[0]
        assert stream.status == 200 and stream.complete  # the chunked framing ended properly
        name, data = _last_event(stream.body)
        if path == b"/v1/messages":
            assert name == "error" and data["type"] == "error"
            assert data["error"]["type"] == "overloaded_error"  # type: ignore[index]
        else:
            assert name == ("error" if path == b"/v1/responses" else None)
            assert data["error"]["type"] == "service_unavailable"  # type: ignore[index]
        assert "shut down" in orjson.dumps(data).decode()
        if path == b"/v1/chat/completions":
            assert conv.statuses == [200, 503]
            assert conv.answers[1].headers[b"connection"] == b"close"
        else:
            assert conv.statuses == [200]


async def test_requests_not_yet_answered_at_the_timeout_get_503_in_their_format(echo_engines, router):
    [engine] = await echo_engines(1, mode="hang")
    r = await router([engine.url], shutdown_timeout_s=0.3)
    chat = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "a"}]})
    messages = orjson.dumps(STREAMS[b"/v1/messages"])
    conns = []
    for path, body in ((b"/v1/chat/completions", chat), (b"/v1/messages", messages)):
        reader, writer = await connect(r.url)
        writer.write(raw_post(path, body))
        conns.append((path, reader, writer))
    for _ in range(200):  # until both reached the engine
        if len(engine.seen) == 2:
            break
        await asyncio.sleep(0.02)
    report = await r.close()
    assert (report.streams_ended, report.answered_503, report.truncated) == (0, 2, 0)
    for path, reader, writer in conns:
        conv = await read(reader, timeout=10)
        writer.close()
        assert conv.statuses == [503] and conv.closed
        doc = orjson.loads(conv.answers[0].body)
        if path == b"/v1/messages":
            assert doc["error"]["type"] == "overloaded_error"
        else:
            assert doc["error"]["type"] == "service_unavailable"


async def test_kvroute_serve_exits_non_zero_and_logs_when_the_timeout_cut_streams(echo_engines):
    [engine] = await echo_engines(1, events=400, delay_s=0.05)
    port = free_port()
    env = {**os.environ, "KVROUTE_SHUTDOWN_TIMEOUT_S": "0.3", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = await asyncio.create_subprocess_exec(
        *SERVE, "--worker", engine.url, "--port", str(port), "--log-level", "info",
        stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.returncode is None
            try:
                reader, writer = await connect(url)
                break
            except OSError:
                await asyncio.sleep(0.05)
        writer.write(raw_post(b"/v1/messages", orjson.dumps(STREAMS[b"/v1/messages"])))
        conv = Conversation()
        conv.feed(await asyncio.wait_for(reader.read(65536), 10))
        proc.send_signal(signal.SIGTERM)
        await read(reader, conv, timeout=20)
        writer.close()
        assert conv.statuses == [200] and conv.answers[0].complete
        assert _last_event(conv.answers[0].body)[0] == "error"
        code = await asyncio.wait_for(proc.wait(), 20)
        log = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
        assert code == 3, log
        assert "up to" in log and "client connections" in log
        assert "stream ended with an error event: /v1/messages" in log
        assert "1 request(s) cut" in log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
