"""What relaying one event costs the proxy, in-process: ``Exchange._feed`` and ``_flush`` (one event per
read, as engines write them) with a writer that drops the bytes, for an OpenAI and an Anthropic
event.  The best of several rounds, in microseconds per event.

Run it against another checkout's ``src`` (e.g. main's, from ``git archive``) to compare, in
alternation so that the machine's other load falls on both alike:

    PYTHONPATH=src python3 benchmarks/bench_relay.py
    for i in 1 2 3; do PYTHONPATH=BASE/src python3 benchmarks/bench_relay.py; \\
                       PYTHONPATH=src python3 benchmarks/bench_relay.py; done
"""

from __future__ import annotations

import argparse
import inspect
import time
import types
from collections.abc import Callable
from typing import Any

import orjson

from kvroute.router_settings import Settings
from kvroute.server import proxy
from kvroute.server.usage import UsageSniffer

CHAT = b"data: " + orjson.dumps({
    "id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1,
    "model": "qwen3-4b",
    "choices": [{"index": 0, "delta": {"content": " the"}, "logprobs": None, "finish_reason": None}],
}) + b"\n\n"
ANTHROPIC = (b"event: content_block_delta\ndata: " + orjson.dumps({
    "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " the"}}) + b"\n\n")


class _Sink:
    """Stands in for the client's writer, the dispatcher, the histogram and the upstream call."""

    def write(self, data: bytes) -> None:
        pass

    def first_byte(self, flight: Any) -> None:
        pass

    def observe(self, value: float) -> None:
        pass

    completed = False  # as an upstream call: its answer is still arriving

    def fail(self, reason: str, detail: str) -> None:
        raise SystemExit(f"the relay rejected a well-formed event: {detail}")


def relay_of(sink: _Sink) -> tuple[Callable[[bytes], None], Callable[[], None]]:
    """The relay's per-chunk and per-read functions on a stream, over stand-ins."""
    router = types.SimpleNamespace(dispatch=sink, metrics=types.SimpleNamespace(ttfb=sink),
                                   settings=Settings())
    if hasattr(proxy, "Exchange"):  # the request's life as one object
        stand_in = types.SimpleNamespace(router=router)
        exchange = proxy.Exchange(stand_in, None, sink, None, None, time.perf_counter())  # type: ignore[arg-type]
        exchange.sse, exchange.call, exchange.usage = True, sink, UsageSniffer(True)
        exchange.flight = types.SimpleNamespace()  # what the dispatcher's first_byte is told
        return exchange._feed, exchange._flush
    args: list[Any] = [sink, True, UsageSniffer(True), time.perf_counter(), None, router]
    if "call" in inspect.signature(proxy._Relay.__init__).parameters:  # older checkouts have no call
        args.append(sink)
    relay = proxy._Relay(*args)
    return relay.feed, relay.flush


def per_event_us(event: bytes, events: int) -> float:
    feed, flush = relay_of(_Sink())
    started = time.perf_counter()
    for _ in range(events):
        feed(event)
        flush()
    return (time.perf_counter() - started) / events * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=50_000, help="events per round (default 50000)")
    p.add_argument("--rounds", type=int, default=7, help="rounds; the best is kept (default 7)")
    args = p.parse_args()
    best = {"openai": float("inf"), "anthropic": float("inf")}
    for _ in range(args.rounds):
        best["openai"] = min(best["openai"], per_event_us(CHAT, args.events))
        best["anthropic"] = min(best["anthropic"], per_event_us(ANTHROPIC, args.events))
    print(f"{proxy.__file__}: " + "   ".join(f"{k} {v:.2f} µs/event" for k, v in best.items()))


if __name__ == "__main__":
    main()
