"""The router's listening side at the HTTP level, with raw sockets: what SDKs never exercise but
other clients, health checkers and proxies in front of the router do."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

import httptools
import orjson

CHAT = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]})


class _Answers:
    """Collects responses parsed off one connection."""

    def __init__(self) -> None:
        self.done: list[tuple[int, dict[bytes, bytes], bytes]] = []
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._headers, self._body = {}, []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._headers, b"".join(self._body)))


async def _connect(url: str, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    sock = socket.socket()
    if rcvbuf is not None:  # a small window makes the router's writes back up quickly
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    return await asyncio.open_connection(sock=sock, limit=1 << 16)


async def _read_answers(reader: asyncio.StreamReader, count: int, timeout: float = 10.0) -> _Answers:
    answers = _Answers()
    async with asyncio.timeout(timeout):
        while len(answers.done) < count:
            data = await reader.read(65536)
            assert data, f"connection closed after {len(answers.done)} of {count} answers"
            answers.parser.feed_data(data)
    return answers


def _post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + extra + b"content-length: %d\r\n\r\n" % len(body) + body)


async def test_pipelined_requests_are_answered_in_order(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    reader, writer = await _connect(r.url)
    anthropic = orjson.dumps({"model": "echo", "max_tokens": 5,
                              "messages": [{"role": "user", "content": "x"}]})
    writer.write(_post(b"/v1/chat/completions", CHAT) + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
                 + _post(b"/v1/messages", anthropic))
    answers = await _read_answers(reader, 3)
    writer.close()
    statuses = [status for status, _, _ in answers.done]
    assert statuses == [200, 200, 200]
    assert orjson.loads(answers.done[0][2])["object"] == "chat.completion"
    assert orjson.loads(answers.done[1][2]) == {"status": "ok"}
    assert orjson.loads(answers.done[2][2])["type"] == "message"
    assert [s.path for s in engine.seen] == ["/v1/chat/completions", "/v1/messages"]


async def test_expect_continue_gets_a_100_before_the_answer(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    reader, writer = await _connect(r.url)
    head = _post(b"/v1/chat/completions", CHAT, b"expect: 100-continue\r\n")
    head, body = head[:-len(CHAT)], CHAT
    writer.write(head)
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    writer.write(body)
    answers = await _read_answers(reader, 1)
    writer.close()
    assert answers.done[0][0] == 200 and engine.seen[0].body == CHAT
    assert "expect" not in {k.lower() for k in engine.seen[0].headers}


async def test_an_http_1_0_client_gets_a_complete_answer_and_the_connection_closes(echo_engines, router):
    [engine] = await echo_engines(1, events=4)
    r = await router([engine.url])
    reader, writer = await _connect(r.url)
    stream = orjson.dumps({"model": "echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: %d\r\n\r\n" % len(stream) + stream)
    raw = await asyncio.wait_for(reader.read(), 10)  # read() returns at the close
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200")
    assert b"transfer-encoding" not in head.lower()  # HTTP/1.0 has no chunked framing
    assert body.endswith(b"data: [DONE]\n\n")


async def test_head_request_has_the_length_but_no_body(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    reader, writer = await _connect(r.url)
    writer.write(b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    assert length > 0
    # The next bytes are the second answer, not a body of the first.
    second = await _read_answers(reader, 1)
    writer.close()
    assert second.done[0][0] == 200 and len(second.done[0][2]) == length


async def test_a_malformed_request_gets_400_and_the_connection_closes(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    reader, writer = await _connect(r.url)
    writer.write(b"NOT-HTTP at all\r\n\r\n")
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert raw.startswith(b"HTTP/1.1 400")
    async with http.post(r.url + "/v1/chat/completions", data=CHAT) as resp:
        assert resp.status == 200


async def test_a_slow_reader_gets_a_long_stream_whole(echo_engines, router):
    """The router stops reading from the worker while the client lags, and resumes: nothing is
    lost or reordered."""
    [engine] = await echo_engines(1, events=40000)
    r = await router([engine.url])
    reader, writer = await _connect(r.url, rcvbuf=4096)
    stream = orjson.dumps({"model": "echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    writer.write(_post(b"/v1/chat/completions", stream))
    await asyncio.sleep(0.5)  # the worker has written everything; the router must hold or pause
    answers = await _read_answers(reader, 1, timeout=30)
    writer.close()
    status, _, body = answers.done[0]
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    choices = [orjson.loads(e[6:])["choices"] for e in events]
    numbered = [c[0]["delta"]["content"] for c in choices if c]
    assert numbered == [f"w{i} " for i in range(40000)]


async def test_upstream_connections_are_kept_alive(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    for _ in range(20):
        async with http.post(r.url + "/v1/chat/completions", data=CHAT) as resp:
            assert resp.status == 200
    pool = r.router.upstream
    assert pool is not None
    assert pool.connection_count(engine.url) == 1
