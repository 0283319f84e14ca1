"""Instructions per call of the small patterns a request repeats, before and after each cut of
docs/benchmarks.md's "2026-12-07: instructions per request" (and "2026-12-08: more instructions
per request"): each case runs 20,000 times in a
fresh interpreter under valgrind's callgrind, and again 0 times; the difference over 20,000, less
the empty loop's, is one call's instructions (exact, whatever the machine's load).

    python benchmarks/opcode_probe/per_call.py             # every case
    python benchmarks/opcode_probe/per_call.py enum_member enum_alias
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

SETUP = r"""
import sys, typing
from dataclasses import dataclass
from enum import Enum, StrEnum
from prometheus_client import CollectorRegistry, Counter, Histogram
from kvroute.server.metrics import TTFB_BUCKETS, LoopHistogram

class Kind(StrEnum):
    COLD = "cold"
class Signal(Enum):
    PREFIX = 1
PREFIX = Signal.PREFIX
kind = Kind.COLD

class Hooked:  # a class with __getattr__, as ModelSettings had
    def __init__(self): self._blocks = {int: 1}
    def block(self, k): return self._blocks.get(k)
    def __getattr__(self, name): raise AttributeError(name)
class Plain:
    def __init__(self): self._blocks = {int: 1}
    def block(self, k): return self._blocks.get(k)
hooked, plain = Hooked(), Plain()

def block_cast(blocks, k):
    found = blocks.get(k)
    return typing.cast(int, found if found is not None else 0)
def block_annotated(blocks, k):
    found = blocks.get(k)
    return found if found is not None else 0
blocks = {int: 1}

FIELDS = [f"f{i}" for i in range(19)]  # RoutingKey's 19
ANNOTATIONS = {"__annotations__": dict.fromkeys(FIELDS, "int")}
Frozen = dataclass(frozen=True, slots=True)(type("Frozen", (), ANNOTATIONS))
Unfrozen = dataclass(slots=True)(type("Unfrozen", (), dict(ANNOTATIONS)))
args = tuple(range(19))

registry = CollectorRegistry()
prometheus_histogram = Histogram("a_seconds", "a", buckets=TTFB_BUCKETS, registry=registry)
loop_histogram = LoopHistogram("b_seconds", "b", TTFB_BUCKETS, registry)

from kvroute.api.requests import RequestHeaders, _header, _reader
headers = RequestHeaders.of([(b"Host", b"x"), (b"Content-Type", b"application/json"),
                             (b"Content-Length", b"900"), (b"Accept", b"*/*"), (b"User-Agent", b"aiohttp")])
read = _reader(headers)

# 2026-12-08
FIELDS12 = {"__annotations__": dict.fromkeys([f"g{i}" for i in range(12)], "int")}  # RoutedRequest's 12
Frozen12 = dataclass(frozen=True, slots=True)(type("Frozen12", (), dict(FIELDS12)))
Unfrozen12 = dataclass(slots=True)(type("Unfrozen12", (), dict(FIELDS12)))
args12 = tuple(range(12))
from kvroute.routing.sync_record import PrefixRecord, SessionRecord
stored = tuple(range(8))
counter = Counter("c", "c", ["worker", "model", "kind"], registry=registry)
children = {}
def count_child(labels):  # the requests counter as RouterMetrics.count_request counted it
    child = children.get(labels)
    if child is None:
        child = children[labels] = counter.labels(*labels)
    child.inc()
from kvroute.server.metrics import LoopCounter
loop_counter = LoopCounter("d", "d", ("worker", "model", "kind"), registry)
labels = ("replica-0", "qwen3-4b", "cold")
from kvroute.routing.view import Candidate
from kvroute.routing.worker import WorkerState
cands2 = [Candidate.of(WorkerState(id=f"w{i}", url="http://x")) for i in range(2)]
cands16 = [Candidate.of(WorkerState(id=f"w{i}", url="http://x")) for i in range(16)]
from kvroute.routing.scheduler import Scheduler
ws2 = [WorkerState(id=f"w{i}", url="http://x", models=frozenset({"m"})) for i in range(2)]
no_events = Scheduler()
some_events = Scheduler()  # one worker elsewhere publishes KV events: every worker is looked at
some_events.exact.attach("elsewhere", [0])
"""

CASES = {
    "empty": "None",
    "enum_member": "Signal.PREFIX",  # Python 3.11: EnumType.__getattr__ makes this the slow path
    "enum_alias": "PREFIX",
    "enum_value": "kind.value",  # an Enum's value is a property
    "block_cast": "block_cast(blocks, int)",
    "block_annotated": "block_annotated(blocks, int)",
    "method_getattr_class": "hooked.block(int)",
    "method_plain_class": "plain.block(int)",
    "frozen_19_fields": "Frozen(*args)",
    "unfrozen_19_fields": "Unfrozen(*args)",
    "prometheus_observe": "prometheus_histogram.observe(0.004)",
    "loop_histogram_observe": "loop_histogram.observe(0.004)",
    "header_function": '_header(headers, "x-kvroute-tenant")',
    "header_reader": 'read("x-kvroute-tenant")',
    "make_reader": "_reader(headers)",
    "frozen_12_fields": "Frozen12(*args12)",
    "unfrozen_12_fields": "Unfrozen12(*args12)",
    "sync_records": '(PrefixRecord("replica-0", 1.0, 2.0, stored, 300), SessionRecord(7, "w", 2.0, True))',
    "prometheus_counter_child": "count_child(labels)",
    "loop_counter_inc": "loop_counter.inc(labels)",
    "min_generator_2": "min(c.busy for c in cands2)",
    "min_list_2": "min([c.busy for c in cands2])",
    "min_generator_16": "min(c.busy for c in cands16)",
    "min_list_16": "min([c.busy for c in cands16])",
    "kind_str": "str(kind)",
    "exact_worker_walk_2": 'some_events.exact_worker("m", ws2)',
    "exact_worker_none_2": 'no_events.exact_worker("m", ws2)',
}


def count(expr: str, n: int, out: Path) -> int:
    """Instructions of a fresh interpreter that sets up, then evaluates ``expr`` ``n`` times."""
    code = SETUP + f"\nf = lambda: {expr}\nfor _ in range({n}):\n    f()\n"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c",
                    code], check=True, capture_output=True, env=os.environ)
    line = next(x for x in out.read_text().splitlines() if x.startswith(("summary:", "totals:")))
    return int(line.split()[1])


def main(names: list[str]) -> None:
    n = 20_000
    with tempfile.TemporaryDirectory() as tmp:
        def per_call(name: str) -> float:
            runs = count(CASES[name], n, Path(tmp, f"{name}.n"))
            return (runs - count(CASES[name], 0, Path(tmp, f"{name}.0"))) / n
        empty = per_call("empty")
        print(f"| case | `f()` evaluates | instructions per call (less the empty loop's {empty:.0f}) |")
        print("|---|---|---:|")
        for name in names or [c for c in CASES if c != "empty"]:
            print(f"| {name} | `{CASES[name]}` | {per_call(name) - empty:,.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
