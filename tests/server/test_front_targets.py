"""Request targets, methods and hop-by-hop headers at the listening side (issue 24, item 6), over
raw sockets against a real router and a real engine on loopback: absolute-form targets are served
by their path, every 404 and 405 is JSON in the API's format, CONNECT is refused, and hop-by-hop
headers cross the router in neither direction."""

from __future__ import annotations

import orjson
import pytest

from kvroute_dev.raw_http import exchange, post

CHAT = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]})
MESSAGES = orjson.dumps({"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})


def _error(body: bytes, style: str) -> str:
    doc = orjson.loads(body)
    if style == "anthropic":
        assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}
    else:
        assert set(doc["error"]) == {"message", "type", "param", "code"}
    return str(doc["error"]["message"])


async def test_absolute_form_targets_are_served_by_their_path(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    conv = await exchange(r.url, post(b"http://router.example/v1/chat/completions?x=1", CHAT), count=1)
    assert conv.statuses == [200]
    assert orjson.loads(conv.answers[0].body)["object"] == "chat.completion"
    assert engine.seen[-1].path == "/v1/chat/completions"
    conv = await exchange(r.url, post(b"HTTPS://router.example:8443/v1/messages", MESSAGES), count=1)
    assert conv.statuses == [200]
    assert orjson.loads(conv.answers[0].body)["type"] == "message"
    conv = await exchange(r.url, b"GET http://router.example/health HTTP/1.1\r\nhost: x\r\n\r\n", count=1)
    assert conv.statuses == [200]
    # A wrong method on an absolute-form target: the 405 names the path and what it takes.
    conv = await exchange(r.url, b"GET http://h/v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n", count=1)
    assert conv.statuses == [405]
    assert conv.answers[0].headers[b"allow"] == b"POST"
    message = _error(conv.answers[0].body, "openai")
    assert message == "GET is not allowed on /v1/chat/completions; it takes POST"


@pytest.mark.parametrize(("request_bytes", "status", "style", "message"), [
    (b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n", 404, "openai", "no such endpoint: OPTIONS *"),
    (b"GET /../etc/passwd HTTP/1.1\r\nhost: x\r\n\r\n", 404, "openai",
     "no such endpoint: GET /../etc/passwd"),
    (b"GET /%2e%2e/%2e%2e/etc/passwd HTTP/1.1\r\nhost: x\r\n\r\n", 404, "openai",
     "no such endpoint: GET /../../etc/passwd"),
    (b"GET //admin HTTP/1.1\r\nhost: x\r\n\r\n", 404, "openai", "no such endpoint: GET //admin"),
    (b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\n", 404, "openai", "no such endpoint: GET /nope"),
    (b"GET /v1/messages/nope HTTP/1.1\r\nhost: x\r\n\r\n", 404, "anthropic",
     "no such endpoint: GET /v1/messages/nope"),
    (post(b"/v1/%2e%2e/v1/chat/completions", CHAT), 404, "openai",
     "no such endpoint: POST /v1/../v1/chat/completions"),
    (b"DELETE /health HTTP/1.1\r\nhost: x\r\n\r\n", 405, "openai",
     "DELETE is not allowed on /health; it takes GET, HEAD"),
    (b"PATCH /admin/workers HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n", 405, "openai",
     "PATCH is not allowed on /admin/workers; it takes GET, HEAD, POST"),
    (b"GET /v1/messages HTTP/1.1\r\nhost: x\r\n\r\n", 405, "anthropic",
     "GET is not allowed on /v1/messages; it takes POST"),
])
async def test_every_404_and_405_is_json_in_the_api_format(echo_engines, router, request_bytes, status, style,
                                                            message):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    conv = await exchange(r.url, request_bytes, count=1)
    assert conv.statuses == [status]
    answer = conv.answers[0]
    assert answer.headers[b"content-type"].startswith(b"application/json")
    assert _error(answer.body, style) == message
    assert engine.seen == []


async def test_connect_is_refused_and_the_connection_closes(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    tunnel = b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n\x16\x03\x01 not http"
    conv = await exchange(r.url, tunnel)
    assert conv.statuses == [405] and conv.closed
    assert "CONNECT is not supported" in _error(conv.answers[0].body, "openai")


async def test_hop_by_hop_headers_are_not_forwarded_either_way(echo_engines, router):
    hop = {"Connection": "X-Engine-Hop", "X-Engine-Hop": "1", "Keep-Alive": "timeout=5", "Proxy-Thing": "1",
           "Upgrade": "h2c", "Trailer": "x-sum", "X-Engine-Ok": "1"}
    [engine] = await echo_engines(1, headers=hop)
    r = await router([engine.url])
    extra = (b"connection: keep-alive, X-Client-Hop\r\nx-client-hop: secret\r\nkeep-alive: timeout=9\r\n"
             b"te: trailers\r\ntrailer: x-sum\r\nproxy-authorization: Basic eDp5\r\nproxy-foo: 1\r\n"
             b"x-client-ok: 1\r\n")
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT, extra), count=1)
    assert conv.statuses == [200]
    seen = {k.lower() for k in engine.seen[-1].headers}
    assert "x-client-ok" in seen
    assert not seen & {"x-client-hop", "keep-alive", "te", "trailer", "proxy-authorization", "proxy-foo"}
    answered = set(conv.answers[0].headers)
    assert b"x-engine-ok" in answered
    assert not answered & {b"x-engine-hop", b"keep-alive", b"proxy-thing", b"upgrade", b"trailer"}
    assert b"connection" not in answered  # the router's own: keep-alive needs none
