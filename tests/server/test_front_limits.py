"""Hostile clients at the listening side (issue 17, items 1-8 and 10), over raw sockets against a
real router and a real engine on loopback: every case gets an answer in its API's format, or a
bounded close, and the router keeps serving."""

from __future__ import annotations

import asyncio
import dataclasses

import orjson

from kvroute.api.requests import MAX_JSON_DEPTH
from kvroute.router_settings import Settings
from kvroute.server.app import observer_denied
from kvroute.server.front import FrontLimits, FrontRequest, FrontServer, ResponseWriter, connections_allowed
from kvroute_dev.raw_http import HEALTH, connect, exchange, post, read

CHAT = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]})
MESSAGES = orjson.dumps({"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})


def _openai_error(body: bytes) -> dict[str, object]:
    doc = orjson.loads(body)
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    return doc["error"]  # type: ignore[no-any-return]


def _anthropic_error(body: bytes) -> dict[str, object]:
    doc = orjson.loads(body)
    assert doc["type"] == "error"
    return doc["error"]  # type: ignore[no-any-return]


async def _still_serves(url: str) -> None:
    conv = await exchange(url, post(b"/v1/chat/completions", CHAT), count=1)
    assert conv.statuses == [200]


async def test_a_huge_header_gets_431_without_being_held(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    reader, writer = await connect(r.url)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-big: ")
    for _ in range(64):  # 4 MiB of one header value, in 64 KiB writes
        writer.write(b"a" * 65536)
        if writer.transport.is_closing():
            break
        try:
            await asyncio.wait_for(writer.drain(), 5)
        except (ConnectionError, TimeoutError):
            break
    conv = await read(reader)
    writer.close()
    assert conv.statuses == [431] and conv.closed
    assert "larger than 65536 bytes" in str(_anthropic_error(conv.answers[0].body)["message"])
    assert engine.seen == []
    await _still_serves(r.url)


async def test_too_many_headers_and_a_too_long_target(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], max_headers=20, max_header_bytes=4096)
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(21))
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT, many))
    assert conv.statuses == [431] and conv.closed
    assert "more than 20 request header fields" in str(_openai_error(conv.answers[0].body)["message"])
    conv = await exchange(r.url, b"GET /health?" + b"q" * 5000 + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    assert conv.statuses == [414] and conv.closed
    # Just under the limits: served.
    fine = b"".join(b"x-h%d: v\r\n" % i for i in range(15))
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT, fine), count=1)
    assert conv.statuses == [200]
    assert r.front.rejected == 2


async def test_expect_continue_over_the_body_limit_gets_413_at_once(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], max_body_bytes=1000)
    head = (b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            b"content-length: 5000000\r\n\r\n")
    conv = await exchange(r.url, head, timeout=5)  # no body is ever sent: the answer cannot wait for it
    assert conv.statuses == [413] and conv.closed
    assert _anthropic_error(conv.answers[0].body)["type"] == "request_too_large"
    await _still_serves(r.url)


async def test_header_body_and_idle_timeouts(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], header_timeout_s=0.3, body_timeout_s=0.3, keepalive_timeout_s=0.3)
    # Headers that never end.
    conv = await exchange(r.url, b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n")
    assert conv.statuses == [408] and conv.closed
    assert "headers did not arrive" in str(_anthropic_error(conv.answers[0].body)["message"])
    # A body that stops arriving.
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT)[:-5])
    assert conv.statuses == [408] and conv.closed
    assert "body did not arrive" in str(_openai_error(conv.answers[0].body)["message"])
    # An idle keep-alive connection, after an answer, is closed without a word.
    conv = await exchange(r.url, HEALTH)
    assert conv.statuses == [200] and conv.closed
    # A connection that never sends anything is closed too.
    conv = await exchange(r.url, b"")
    assert conv.statuses == [] and conv.closed
    assert r.front.timed_out == 2
    await _still_serves(r.url)


async def test_at_the_connection_cap_idle_connections_make_room(echo_engines, router):
    [engine] = await echo_engines(1)
    [hung] = await echo_engines(1, mode="hang")
    r = await router([engine.url], max_connections=4, header_timeout_s=30)
    idle = [await connect(r.url) for _ in range(4)]
    await asyncio.sleep(0.1)
    # A fifth client still gets its answer: the oldest idle connection was closed for it.
    conv = await exchange(r.url, HEALTH, count=1)
    assert conv.statuses == [200]
    assert r.front.evicted >= 1
    assert (await read(idle[0][0])).closed
    # They had sent nothing since connecting: evicted as "new"; one idle after an answer is "idle".
    assert r.front.evictions["new"] == r.front.evicted
    kept = await connect(r.url)
    kept[1].write(HEALTH)
    assert (await read(kept[0], count=1)).statuses == [200]
    crowd = [await connect(r.url) for _ in range(4)]
    await asyncio.sleep(0.1)
    assert r.front.evictions["idle"] >= 1
    assert (await read(kept[0])).closed
    for _, w in [kept, *crowd]:
        w.close()
    for _, w in idle:
        w.close()
    await asyncio.sleep(0.1)
    # Connections serving a request are not closed: with every one serving, a newcomer gets a
    # clear 503 in the format of the API it called.
    r2 = await router([hung.url], max_connections=4, header_timeout_s=30)
    serving = [await connect(r2.url) for _ in range(4)]
    for _, w in serving:
        w.write(post(b"/v1/chat/completions", CHAT))
    await asyncio.sleep(0.3)
    conv = await exchange(r2.url, post(b"/v1/messages", MESSAGES))
    assert conv.statuses == [503] and conv.closed
    error = _anthropic_error(conv.answers[0].body)
    assert "connection limit (4 open connections, all serving)" in str(error["message"])
    assert conv.answers[0].headers[b"retry-after"] == b"1"
    assert r2.front.refused == 1 and r2.front.evicted == 0
    for _, w in serving:
        w.close()
    await asyncio.sleep(0.1)
    await _still_serves(r.url)


async def test_upgrade_requests_are_served_over_http_1_1(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    h2c = (b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
           b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n")
    ws = (b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
          b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT, h2c) + ws + HEALTH, count=3)
    assert conv.statuses == [200, 200, 200]
    assert orjson.loads(conv.answers[0].body)["object"] == "chat.completion"
    seen = {k.lower() for k in engine.seen[0].headers}
    # HTTP2-Settings is named by Connection: hop-by-hop, like Upgrade itself.
    assert not seen & {"upgrade", "http2-settings", "connection"} and "content-type" in seen


async def test_requests_before_garbage_are_answered_then_the_connection_closes(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT) + HEALTH + b"NOT HTTP\r\n\r\n")
    assert conv.statuses == [200, 200, 400] and conv.closed
    assert "malformed request" in str(_openai_error(conv.answers[2].body)["message"])
    # Content-Length shorter than the body: the request gets its own answer (the body it
    # announced is not JSON), then the left-over bytes are garbage.
    short = post(b"/v1/messages", MESSAGES).replace(b"content-length: %d" % len(MESSAGES),
                                                    b"content-length: 10")
    conv = await exchange(r.url, short)
    assert conv.statuses == [400, 400] and conv.closed
    assert "not valid JSON" in str(_anthropic_error(conv.answers[0].body)["message"])
    await _still_serves(r.url)


async def test_a_percent_encoded_path_is_decoded_once(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    conv = await exchange(r.url, post(b"/v1/chat/%63ompletions?x=1", CHAT), count=1)
    assert conv.statuses == [200]
    assert engine.seen[-1].path == "/v1/chat/completions"
    conv = await exchange(r.url, b"GET /v1/chat/%63ompletions HTTP/1.1\r\nhost: x\r\n\r\n", count=1)
    assert conv.statuses == [405]
    assert "GET is not allowed on /v1/chat/completions" in str(_openai_error(conv.answers[0].body)["message"])
    conv = await exchange(r.url, post(b"/v1/%2563hat", CHAT), count=1)  # decoded once only: %63hat
    assert conv.statuses == [404]
    assert "/v1/%63hat" in str(_openai_error(conv.answers[0].body)["message"])


def _nested(depth: int) -> str:
    """A marker that ``_deep_body`` replaces by an object nested ``depth`` levels (orjson would
    refuse to write it)."""
    return f"@@{depth}@@"


def _deep_body(doc: object) -> bytes:
    raw = orjson.dumps(doc)
    while b'"@@' in raw:
        start = raw.index(b'"@@')
        end = raw.index(b'@@"', start + 3)
        depth = int(raw[start + 3:end])
        raw = raw[:start] + b'{"a":' * depth + b'"x"' + b"}" * depth + raw[end + 3:]
    return raw


async def test_deeply_nested_json_gets_400_naming_the_field(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    cases = [
        (b"/v1/chat/completions", {"model": "echo", "tools": [_nested(300)],
                                   "messages": [{"role": "user", "content": "x"}]}, "tools[0]"),
        (b"/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _nested(600)}}]}]}, "messages[0].content[0]"),
        (b"/v1/messages", {"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": _nested(1000)}]}]},
         "messages[0].content[0].input"),
        (b"/v1/responses", {"model": "echo", "input": [{"type": "x", "v": _nested(255)}]}, "input[0].v"),
    ]
    for path, doc, field in cases:
        conv = await exchange(r.url, post(path, _deep_body(doc), close=True))
        assert conv.statuses == [400], (path, field)
        body = conv.answers[0].body
        error = _anthropic_error(body) if path == b"/v1/messages" else _openai_error(body)
        message = str(error["message"])
        assert field in message and f"more than {MAX_JSON_DEPTH} levels" in message
    assert engine.seen == []
    # Just under orjson's limit is fine.
    ok = {"model": "echo", "tools": [_nested(MAX_JSON_DEPTH - 3)],
          "messages": [{"role": "user", "content": "x"}]}
    conv = await exchange(r.url, post(b"/v1/chat/completions", _deep_body(ok)), count=1)
    assert conv.statuses == [200]


async def test_an_unexpected_error_is_a_json_500_counted_once_and_logged_briefly(caplog):
    """A real listening side with a handler that fails (the router's handlers catch their own
    errors; this is the last line of defence)."""
    reported: list[str] = []

    async def broken(request: FrontRequest, writer: ResponseWriter) -> None:
        raise KeyError("a bug")

    def internal(what: str) -> None:
        reported.append(what)

    server = FrontServer(broken, internal_error=internal)
    port = await server.start("127.0.0.1", 0)
    try:
        conv = await exchange(f"http://127.0.0.1:{port}", post(b"/v1/messages", MESSAGES) * 3, count=3)
    finally:
        await server.close(1.0)
    assert conv.statuses == [500, 500, 500]
    assert _anthropic_error(conv.answers[0].body)["type"] == "api_error"
    assert reported == ["serving /v1/messages"] * 3


async def test_metrics_and_dashboard_access(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], metrics_access="token", metrics_token="m-token")
    for path in (b"/metrics", b"/dashboard/data.json"):
        conv = await exchange(r.url, b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n", count=1)
        assert conv.statuses == [401]
        wrong = b" HTTP/1.1\r\nhost: x\r\nauthorization: Bearer no\r\n\r\n"
        conv = await exchange(r.url, b"GET " + path + wrong, count=1)
        assert conv.statuses == [403]
    for auth in (b"authorization: Bearer m-token\r\n", b"x-admin-token: secret\r\n"):
        conv = await exchange(r.url, b"GET /metrics HTTP/1.1\r\nhost: x\r\n" + auth + b"\r\n", count=1)
        assert conv.statuses == [200] and b"kvroute_failures_total" in conv.answers[0].body
    conv = await exchange(r.url, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", count=1)
    assert conv.statuses == [200]  # liveness stays open


def test_metrics_access_modes_by_client_address():
    request = FrontRequest(method=b"GET", target=b"/metrics", path="/metrics", headers=[], body=b"",
                           http_minor=1, keep_alive=True)
    loopback = Settings()
    assert loopback.metrics_access == "loopback"
    assert observer_denied(loopback, request, loopback=True) is None
    status, message = observer_denied(loopback, request, loopback=False) or (0, "")
    assert status == 403 and "metrics_token" in message
    with_token = Settings(metrics_token="t")
    assert observer_denied(with_token, request, loopback=False) == (401, observer_denied(
        with_token, request, loopback=False)[1])  # type: ignore[index]
    request.target = b"/metrics?token=t"
    assert observer_denied(with_token, request, loopback=False) is None
    assert observer_denied(Settings(metrics_access="open"), request, loopback=False) is None


async def test_a_long_header_the_front_accepts_is_accepted_behind_it_too(echo_engines, router):
    """The fleet endpoints live in an aiohttp app behind the listening side: its own header
    limits (8190-byte lines by default) must not be stricter than the front's."""
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    cookie = b"cookie: " + b"c" * 30000 + b"\r\n"
    conv = await exchange(r.url, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + cookie + b"\r\n", count=1)
    assert conv.statuses == [200]


async def test_heads_are_measured_across_reads_and_big_bodies_are_not_mistaken_for_heads(
        echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], max_header_bytes=16384)
    for size, expected in ((15000, [200]), (17000, [431])):
        reader, writer = await connect(r.url)
        # /health: the app behind the front takes long headers (the echo engine would not).
        request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"v" * size + b"\r\n\r\n"
        for i in range(0, len(request), 1000):  # a head arriving in many reads
            writer.write(request[i:i + 1000])
            await writer.drain()
            await asyncio.sleep(0.001)
        conv = await read(reader, count=1)
        writer.close()
        assert conv.statuses == expected
    # Large bodies pipelined with small heads, in one write: reads mix bodies and heads.
    big = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "w" * 200_000}]})
    conv = await exchange(r.url, post(b"/v1/chat/completions", big) * 3 + HEALTH, count=4)
    assert conv.statuses == [200, 200, 200, 200]


async def test_a_repeated_single_header_on_a_fleet_endpoint_is_a_clean_400(echo_engines, router, caplog):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    twice = b"GET /v1/models HTTP/1.1\r\nhost: x\r\ncontent-type: a\r\ncontent-type: b\r\n\r\n"
    conv = await exchange(r.url, twice, count=1)
    assert conv.statuses == [400]
    assert "content-type header appears more than once" in str(_openai_error(conv.answers[0].body)["message"])
    assert "Traceback" not in caplog.text


def test_the_listening_limits_take_their_defaults_from_the_settings():
    limits = FrontLimits.from_settings(open_files=4096)
    defaults = Settings()
    for field in dataclasses.fields(FrontLimits):
        if field.name != "max_connections":
            assert getattr(limits, field.name) == getattr(defaults, field.name), field.name
    # max_connections = 0 (the default) derives the cap from the open-file limit, as serve does.
    assert defaults.max_connections == 0 and limits.max_connections == connections_allowed(4096)
    s = Settings.from_dict({"max_connections": 300, "body_timeout_s": 5})
    assert FrontLimits.from_settings(s).max_connections == 300
    assert FrontLimits.from_settings(s).body_timeout_s == 5
    assert FrontServer(_never_called).limits == FrontLimits.from_settings()


async def _never_called(request: FrontRequest, writer: ResponseWriter) -> None:
    raise AssertionError("no request is served")
