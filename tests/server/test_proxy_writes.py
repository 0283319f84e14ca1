"""How many writes a relayed answer costs the router: each one is a system call, the largest part
of a small request's CPU (docs/benchmarks.md, "Where a small request's time goes").  A stream's head
leaves with its first event, and its last bytes with the end of the response."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest

from kvroute.server import front
from kvroute_dev.raw_http import exchange, post

CHAT = orjson.dumps({"model": "echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture
def client_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """Every write the listening side makes to a client, in order."""
    writes: list[bytes] = []
    original = front._FrontConnection.write

    def counted(self: front._FrontConnection, data: bytes) -> None:
        writes.append(data)
        original(self, data)

    monkeypatch.setattr(front._FrontConnection, "write", counted)
    yield writes


async def test_a_stream_read_in_one_piece_leaves_in_one_write(echo_engines, router, client_writes):
    [engine] = await echo_engines(1, mode="whole", events=4)
    r = await router([engine.url])
    client_writes.clear()
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT), count=1)
    assert conv.statuses == [200]
    body = conv.answers[0].body
    assert body.count(b"data: ") == 4 + 2 and body.rstrip().endswith(b"data: [DONE]")
    # The head, every event and the chunked framing's end: one write (before: head, events, end).
    [only] = client_writes
    assert only.startswith(b"HTTP/1.1 200") and only.endswith(b"\r\n0\r\n\r\n")
    assert b"data: [DONE]" in only


async def test_a_streams_head_leaves_with_its_first_event(echo_engines, router, client_writes):
    [engine] = await echo_engines(1, events=3, delay_s=0.05)
    r = await router([engine.url])
    client_writes.clear()
    conv = await exchange(r.url, post(b"/v1/chat/completions", CHAT), count=1)
    assert conv.statuses == [200]
    first = client_writes[0]
    assert first.startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in first
    head, _, rest = first.partition(b"\r\n\r\n")
    assert b"text/event-stream" in head and b"data: {" in rest  # the first event, in the same write
    # The events came apart (0.05 s between them): each left when it came, none was held back.
    assert len(client_writes) >= 4
    assert client_writes[-1].endswith(b"0\r\n\r\n")
