"""What a small request's bookkeeping costs in-process, before and after the cuts of issue 26's hot
path (docs/benchmarks.md, "Garbage and bookkeeping per request"): the headers
``parse_request`` reads (a ``CIMultiDict`` built per request, or ``RequestHeaders``), the request
counter (``labels(...)`` per request, or the cached child) and a decision log line's record (with
or without the process id, thread and process name no format shows); then decision lines logged
on an event loop to ``/dev/null`` (a write system call each, as on standard error), through
logging's own handler and text formatter or through ``log_setup``'s (a write per turn of the
loop, the time's second formatted once a second, no source-line lookup), 1 and 16 lines a turn.

    python benchmarks/bench_request_bookkeeping.py            # best of 7 rounds, 20,000 calls each

Old and new alternate within each round, so the machine's other load falls on both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import time
from collections.abc import Callable, Mapping

import orjson
from multidict import CIMultiDict

from kvroute.api.requests import RequestHeaders, RequestOptions, priority_of, session_id_of, tenant_of
from kvroute.fleet.registry import Registry
from kvroute.log_setup import LineHandler, TextFormatter
from kvroute.server.metrics import RouterMetrics

# The benchmark client's headers (aiohttp), as the listening side parses them.
HEADERS = [(b"Host", b"127.0.0.1:8000"), (b"User-Agent", b"Python/3.11 aiohttp/3.14.5"), (b"Accept", b"*/*"),
           (b"Accept-Encoding", b"gzip, deflate"), (b"Content-Type", b"application/json"),
           (b"Content-Length", b"1050")]
BODY = orjson.loads(orjson.dumps({"model": "qwen3-4b", "max_tokens": 16, "stream": False, "messages": [
    {"role": "user", "content": "tell me something about routing and caches. " * 20}]}))


def per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def loop_lines_us(log: logging.Logger, per_turn: int, n: int) -> float:
    """A decision line's cost on an event loop, ``per_turn`` lines a turn, the turns included."""
    async def turns() -> float:
        start = time.perf_counter()
        for _ in range(n // per_turn):
            for _ in range(per_turn):
                log.info("%s model=%s worker=%s%s", "[AUTO] sticky: a21455e0 stays on 127.0.0.1:8001",
                         "qwen3-4b", "127.0.0.1:8001", "")
            await asyncio.sleep(0)
        return (time.perf_counter() - start) / (n // per_turn * per_turn) * 1e6
    return asyncio.run(turns())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20_000)
    args = p.parse_args()

    metrics = RouterMetrics(Registry(), dict)
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    decision_log = logging.getLogger("kvroute.decision")
    decision_log.addHandler(handler)
    decision_log.setLevel(logging.INFO)
    decision_log.propagate = False

    def log_line() -> None:
        decision_log.info("%s model=%s worker=%s%s", "[AUTO] sticky: a21455e0 stays on 127.0.0.1:8001",
                          "qwen3-4b", "127.0.0.1:8001", "")

    def record_flags(on: bool) -> None:
        logging.logProcesses = logging.logThreads = logging.logMultiprocessing = on

    options = RequestOptions()

    def read_headers(headers: Mapping[str, str]) -> None:
        # What parse_request asks of them: the session sources, priority and tenant.
        session_id_of(BODY, headers, options)
        priority_of(headers)
        tenant_of(headers)

    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("request headers: built and read",
         lambda: read_headers(CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in HEADERS)),
         lambda: read_headers(RequestHeaders.of(HEADERS))),
        ("kvroute_requests_total +1",
         lambda: metrics.requests.labels("127.0.0.1:8001", "qwen3-4b", "sticky").inc(),
         lambda: metrics.count_request("127.0.0.1:8001", "qwen3-4b", "sticky")),
        ("decision log line (INFO)", log_line, log_line),
    ]
    # Before each run of a case: the log records' flags as before (on) or after (off) the cut.
    flags = {"decision log line (INFO)": record_flags}
    best: dict[str, list[float]] = {name: [float("inf"), float("inf")] for name, _, _ in cases}
    for _ in range(args.rounds):
        for name, old, new in cases:
            for i, fn in enumerate((old, new)):
                if name in flags:
                    flags[name](i == 0)
                best[name][i] = min(best[name][i], per_call_us(fn, args.calls))
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    with open(os.devnull, "w") as devnull:
        loggers = []
        for name, handler_to, formatter in (("old", logging.StreamHandler(devnull), logging.Formatter(fmt)),
                                            ("new", LineHandler(devnull), TextFormatter(fmt))):
            handler_to.setFormatter(formatter)
            log = logging.getLogger(f"kvroute.bench.{name}")
            log.addHandler(handler_to)
            log.setLevel(logging.INFO)
            log.propagate = False
            loggers.append(log)
        srcfile = logging._srcfile
        record_flags(False)
        for per_turn in (1, 16):
            name = f"decision line on a loop, {per_turn} a turn"
            best[name] = [float("inf"), float("inf")]
            for _ in range(args.rounds):
                for i, log in enumerate(loggers):
                    logging._srcfile = srcfile if i == 0 else None
                    best[name][i] = min(best[name][i], loop_lines_us(log, per_turn, args.calls))
        logging._srcfile = srcfile
    print(f"best of {args.rounds} rounds, {args.calls} calls each (µs per call)")
    print("| step | before | after | saved |\n|---|---:|---:|---:|")
    for name, (old_us, new_us) in best.items():
        print(f"| {name} | {old_us:.2f} | {new_us:.2f} | {old_us - new_us:.2f} |")


if __name__ == "__main__":
    main()
