"""Hostile request bodies at the listening side (issue 24, items 1 and 2), over raw sockets against
a real router and a real engine on loopback: chunk extensions and trailers are bounded like a
head and never forwarded, a body must arrive whole within its deadline and at a minimum rate, and
connections reading slow bodies cannot lock others out at the connection cap."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from urllib.parse import urlsplit

import orjson

from kvroute.prometheus_text import parse_exposition
from kvroute_dev.raw_http import HEALTH, Conversation, connect, exchange, post, read

CHAT = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]})
MESSAGES = orjson.dumps({"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})


def _chunked_head(path: bytes) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


def _chunked(path: bytes, body: bytes, *, extension: bytes = b"", trailers: bytes = b"") -> bytes:
    """A chunked POST of ``body`` in two chunks, the first with ``extension``, then ``trailers``."""
    half = len(body) // 2
    return (_chunked_head(path) + b"%x%s\r\n%s\r\n" % (half, extension, body[:half])
            + b"%x\r\n%s\r\n" % (len(body) - half, body[half:]) + b"0\r\n" + trailers + b"\r\n")


def _message(body: bytes) -> str:
    doc = orjson.loads(body)
    error = doc["error"]
    if doc.get("type") == "error":  # Anthropic's format
        assert set(error) == {"type", "message"}
    else:
        assert set(error) == {"message", "type", "param", "code"}
    return str(error["message"])


async def front_counters(url: str) -> dict[tuple[str, str], float]:
    """The listening side's counters as /metrics shows them: (name, reason) -> value."""
    conv = await exchange(url, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n", count=1)
    assert conv.statuses == [200]
    names = ["kvroute_front_evictions_total", "kvroute_front_body_timeouts_total"]
    return {(s.name, s.labels["reason"]): s.value
            for s in parse_exposition(conv.answers[0].body.decode(), names)}


async def _send_slowly(writer: asyncio.StreamWriter, first: bytes, block: bytes, blocks: int) -> None:
    """Write ``first``, then up to ``blocks`` copies of ``block``, each in its own read, until the
    router stops reading."""
    writer.write(first)
    for _ in range(blocks):
        if writer.transport.is_closing():
            return
        try:
            await asyncio.wait_for(writer.drain(), 5)
        except (ConnectionError, TimeoutError):
            return
        await asyncio.sleep(0.002)
        writer.write(block)


async def test_trailers_are_dropped_and_never_reach_the_worker(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    trailers = b"x-trailer-one: 1\r\nauthorization: Bearer forged\r\n"
    conv = await exchange(r.url, _chunked(b"/v1/chat/completions", CHAT, extension=b";name=value",
                                          trailers=trailers) + HEALTH, count=2)
    assert conv.statuses == [200, 200]
    seen = {k.lower(): v for k, v in engine.seen[-1].headers.items()}
    assert "x-trailer-one" not in seen and "authorization" not in seen
    assert engine.seen[-1].body == CHAT


async def test_too_many_or_too_large_trailers_get_431(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], max_headers=20, max_header_bytes=4096)
    many = b"".join(b"x-t%d: v\r\n" % i for i in range(21))
    conv = await exchange(r.url, _chunked(b"/v1/messages", MESSAGES, trailers=many))
    assert conv.statuses == [431] and conv.closed
    assert "more than 20 trailer fields" in _message(conv.answers[0].body)
    # Over the byte limit in one read (one trailer of 5,000 bytes).
    big = b"x-big: " + b"a" * 5000 + b"\r\n"
    conv = await exchange(r.url, _chunked(b"/v1/chat/completions", CHAT, trailers=big))
    assert conv.statuses == [431] and conv.closed
    assert "trailer fields larger than 4096 bytes" in _message(conv.answers[0].body)
    # Just under the limits: served, and the trailers stay behind.
    fine = b"".join(b"x-t%d: v\r\n" % i for i in range(15))
    conv = await exchange(r.url, _chunked(b"/v1/chat/completions", CHAT, trailers=fine), count=1)
    assert conv.statuses == [200]
    assert not any(k.lower().startswith("x-t") for k in engine.seen[-1].headers)
    assert len(engine.seen) == 1


async def test_a_huge_trailer_gets_431_without_being_held(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    reader, writer = await connect(r.url)
    first = _chunked_head(b"/v1/messages") + b"%x\r\n%s\r\n0\r\nx-big: " % (len(MESSAGES), MESSAGES)
    # Up to 8 MiB of one trailer value in 64 KiB writes; the router answers after ~64 KiB.
    sending = asyncio.create_task(_send_slowly(writer, first, b"a" * 65536, 128))
    conv = await read(reader)
    await sending
    writer.close()
    assert conv.statuses == [431] and conv.closed
    assert "larger than 65536 bytes" in _message(conv.answers[0].body)
    assert engine.seen == []
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT), count=1)
    assert conv.statuses == [200]


async def test_a_huge_chunk_extension_gets_431(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    reader, writer = await connect(r.url)
    first = _chunked_head(b"/v1/chat/completions") + b"%x;e=" % len(CHAT)
    sending = asyncio.create_task(_send_slowly(writer, first, b"a" * 65536, 128))
    conv = await read(reader)
    await sending
    writer.close()
    assert conv.statuses == [431] and conv.closed
    assert "chunk extensions and trailer fields larger than 65536 bytes" in _message(conv.answers[0].body)
    # Many small chunks, each with a short extension, add up the same way.
    reader, writer = await connect(r.url)
    chunk = b"1;ext=" + b"x" * 100 + b"\r\n{\r\n"
    sending = asyncio.create_task(_send_slowly(writer, _chunked_head(b"/v1/messages"), chunk * 64, 200))
    conv = await read(reader)
    await sending
    writer.close()
    assert conv.statuses == [431] and conv.closed
    assert engine.seen == []
    # Plain small chunks spread over many reads are framing, not extensions: served.
    body = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "a" * 3000}]})
    reader, writer = await connect(r.url)
    writer.write(_chunked_head(b"/v1/chat/completions"))
    for i in range(0, len(body), 7):
        writer.write(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]))
        if i % 700 == 0:
            await writer.drain()
            await asyncio.sleep(0.001)
    writer.write(b"0\r\n\r\n")
    conv = await read(reader, count=1)
    writer.close()
    assert conv.statuses == [200]
    assert engine.seen[-1].body == body


async def test_a_body_must_arrive_within_its_deadline_and_at_the_minimum_rate(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], body_timeout_s=1.2, body_min_rate_bytes_s=100, body_min_rate_grace_s=0.3)
    # One byte every 0.1 s: 10 bytes/s, never silent for long, but too slow.
    reader, writer = await connect(r.url)
    writer.write(post(b"/v1/messages", MESSAGES)[:-len(MESSAGES)])
    conv = Conversation()
    for byte in MESSAGES[:30]:
        writer.write(bytes([byte]))
        await asyncio.sleep(0.1)
        if reader.at_eof() or len(reader._buffer):  # the router answered
            break
    conv = await read(reader, conv)
    writer.close()
    assert conv.statuses == [408] and conv.closed
    assert "body arrived slower than 100 bytes/s" in _message(conv.answers[0].body)
    # Fast enough on average, but the whole body takes longer than body_timeout_s.
    long_body = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "a" * 3000}]})
    reader, writer = await connect(r.url)
    writer.write(post(b"/v1/chat/completions", long_body)[:-len(long_body)])
    for i in range(0, len(long_body), 40):
        writer.write(long_body[i:i + 40])
        await asyncio.sleep(0.05)  # 800 bytes/s
        if reader.at_eof() or len(reader._buffer):
            break
    conv = await read(reader)
    writer.close()
    assert conv.statuses == [408] and conv.closed
    assert "body did not arrive within 1.2 s" in _message(conv.answers[0].body)
    assert r.front.timed_out == 2 and engine.seen == []
    counters = await front_counters(r.url)
    assert counters[("kvroute_front_body_timeouts_total", "min_rate")] == 1
    assert counters[("kvroute_front_body_timeouts_total", "total")] == 1
    assert sum(n for (name, _), n in counters.items() if name == "kvroute_front_evictions_total") == 0
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT), count=1)
    assert conv.statuses == [200]


async def _drip(url: str, stop: asyncio.Event) -> str:
    """A client sending its body one byte at a time: what happened to it."""
    reader, writer = await connect(url)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
    try:
        while not stop.is_set():
            writer.write(b"{")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stop.wait()), 0.3)
            if reader.at_eof() or len(reader._buffer):
                conv = await read(reader, timeout=5)
                return f"{conv.statuses}"
        return "still dripping"
    except ConnectionError:
        return "reset"
    finally:
        writer.close()


async def test_slow_bodies_at_the_cap_lock_nobody_out(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], max_connections=20, body_min_rate_grace_s=30, header_timeout_s=30)
    stop = asyncio.Event()
    drippers = []
    for _ in range(30):
        drippers.append(asyncio.create_task(_drip(r.url, stop)))
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    assert r.front.connection_count == 20
    # The router has room for a complete request and for /health: the slowest drippers make it.
    for _ in range(3):
        conv = await exchange(r.url, post(b"/v1/messages", MESSAGES), count=1, timeout=5)
        assert conv.statuses == [200]
        conv = await exchange(r.url, HEALTH, count=1, timeout=5)
        assert conv.statuses == [200]
    stop.set()
    outcomes = Counter(await asyncio.gather(*drippers))
    # Each dripper closed to make room was told why (408); the others were left alone.
    assert set(outcomes) <= {"[408]", "still dripping"}, outcomes
    assert 10 <= outcomes["[408]"] <= r.front.evicted
    assert r.front.refused == 0
    # /metrics counts them by what they were doing: each dripper was sending its body.
    counters = await front_counters(r.url)
    assert counters[("kvroute_front_evictions_total", "slow_body")] >= outcomes["[408]"]
    assert counters[("kvroute_front_evictions_total", "slow_body")] == r.front.evictions["slow_body"]
    assert counters[("kvroute_front_body_timeouts_total", "min_rate")] == 0  # evicted, not timed out


def _burst(url: str, count: int) -> list[str]:
    """Open ``count`` connections and send a complete request on each before reading any answer
    (blocking sockets, so that the router sees them arrive together); what each one got."""
    parts = urlsplit(url)
    sockets = []
    for i in range(count):
        sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
        sock.sendall(post(b"/v1/messages", MESSAGES) if i % 2 else post(b"/v1/chat/completions", CHAT))
        sockets.append(sock)
    outcomes = []
    for i, sock in enumerate(sockets):
        conv = Conversation()
        try:
            while not conv.answers:
                data = sock.recv(65536)
                if not data:
                    conv.eof()
                    break
                conv.feed(data)
        except ConnectionResetError:
            conv.reset = True
        finally:
            sock.close()
        if not conv.answers:
            outcomes.append("reset" if conv.reset else "EOF without an answer")
        else:
            answer = conv.answers[0]
            if answer.status == 503:  # in the format of the API called
                assert (orjson.loads(answer.body).get("type") == "error") == (i % 2 == 1)
                assert "connection limit" in _message(answer.body)
            outcomes.append(str(answer.status))
    return outcomes


async def test_at_the_cap_a_request_already_sent_is_answered(echo_engines, router):
    [engine] = await echo_engines(1)
    r = await router([engine.url], max_connections=10)
    for _ in range(3):
        outcomes = Counter(await asyncio.to_thread(_burst, r.url, 30))
        assert set(outcomes) <= {"200", "503"}, outcomes
        assert outcomes["200"] >= 10


async def test_a_pipelined_body_keeps_its_deadline_while_the_one_before_it_is_served(echo_engines, router):
    [engine] = await echo_engines(1, delay_s=1.5)
    # (header_timeout_s long: the deadline at work is the body's, not a head's)
    r = await router([engine.url], body_timeout_s=0.5, body_min_rate_bytes_s=0, header_timeout_s=30)
    reader, writer = await connect(r.url)
    # The first request is answered after 1.5 s; the second's body stops halfway meanwhile.
    second = post(b"/v1/messages", MESSAGES)
    writer.write(post(b"/v1/chat/completions", CHAT) + second[:-10])
    conv = await read(reader, timeout=10)
    writer.close()
    assert conv.statuses == [200, 408] and conv.closed
    assert "body did not arrive within 0.5 s" in _message(conv.answers[1].body)
    assert len(engine.seen) == 1
