"""A finished request leaves no reference cycle behind: its objects (the proxy's ``Exchange``, the
upstream ``Call``, the front's request and writer, the decision...) are freed by reference
counting the moment it ends.  A cycle among them made every request garbage for the cyclic
collector, whose collections then cost a router tens of µs per request (docs/benchmarks.md,
"Garbage and bookkeeping per request")."""

from __future__ import annotations

import gc
from collections import Counter

import orjson
import pytest

from kvroute_dev.raw_http import Conversation, connect, post, read


def _ours(obj: object) -> str | None:
    """The name of ``obj``'s kvroute type or code (None: something else's: the echo engine's,
    aiohttp's, the test client's)."""
    kind = type(obj)
    if kind.__module__.startswith("kvroute."):
        return kind.__qualname__
    code = getattr(obj, "cr_code", None) or getattr(obj, "f_code", None) or getattr(obj, "__code__", None)
    if code is not None and "/kvroute/" in code.co_filename:
        return f"{kind.__name__} {code.co_name}"
    func = getattr(obj, "__func__", None)
    if func is not None and getattr(func, "__module__", "").startswith("kvroute."):
        return f"method {func.__qualname__}"
    return None


async def _requests(url: str, path: bytes, body: bytes, n: int) -> list[int]:
    """``n`` requests one after another on one keep-alive connection: their statuses."""
    reader, writer = await connect(url)
    conv = Conversation()
    try:
        for i in range(n):
            writer.write(post(path, body))
            await read(reader, conv, count=i + 1)
    finally:
        writer.close()
    return [answer.status for answer in conv.answers]


def _chat(stream: bool, model: str = "echo") -> bytes:
    """A small request, the same for OpenAI's chat completions and Anthropic's messages."""
    return orjson.dumps({"model": model, "stream": stream, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "how are caches shared?"}]})


@pytest.mark.parametrize(("path", "body"), [
    (b"/v1/chat/completions", _chat(False)),
    (b"/v1/chat/completions", _chat(True)),
    (b"/v1/messages", _chat(True)),
], ids=["openai-plain", "openai-stream", "anthropic-stream"])
async def test_a_relayed_request_leaves_no_cycle(echo_engines, router, path, body):
    [engine] = await echo_engines(1, events=3)
    r = await router([engine.url])
    assert await _requests(r.url, path, body, 3) == [200] * 3  # warm: pool, caches, sessions
    with _collecting() as garbage:
        assert await _requests(r.url, path, body, 20) == [200] * 20
    assert _kvroute_garbage(garbage) == Counter()


async def test_retried_and_refused_requests_leave_no_cycle(echo_engines, router):
    # One worker answers 500 (held, then retried on the other) or a malformed body (retried),
    # and a request for a model nobody serves is refused: the failure paths free their objects too.
    failing, garbled, ok = await echo_engines(3)
    r = await router([failing.url, garbled.url, ok.url], retries=2)
    assert await _requests(r.url, b"/v1/chat/completions", _chat(False), 3) == [200] * 3
    failing.mode, garbled.mode = "error", "garbage"
    tried = len(failing.seen) + len(garbled.seen)
    unknown = _chat(False, model="nobody")
    with _collecting() as garbage:
        for stream in (False, True):
            assert await _requests(r.url, b"/v1/chat/completions", _chat(stream), 10) == [200] * 10
        assert await _requests(r.url, b"/v1/chat/completions", unknown, 3) == [404] * 3
    assert len(failing.seen) + len(garbled.seen) > tried  # some requests were retried
    assert _kvroute_garbage(garbage) == Counter()


class _collecting:
    """``with _collecting() as garbage``: what the cyclic collector found during the block, and
    in one collection at its end (the objects are kept, not freed, so they can be named)."""

    def __enter__(self) -> list[object]:
        gc.collect()
        gc.garbage.clear()
        gc.set_debug(gc.DEBUG_SAVEALL)
        self.found: list[object] = []
        return self.found

    def __exit__(self, *exc: object) -> None:
        try:
            gc.collect()
            self.found.extend(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()


def _kvroute_garbage(garbage: list[object]) -> Counter[str]:
    return Counter(name for obj in garbage if (name := _ours(obj)) is not None)
