"""Logs every cyclic garbage collection of a ``kvroute serve`` process: put this directory on the
router's ``PYTHONPATH`` and set ``KVROUTE_GC_PROBE`` to a directory; at exit the process writes
``gc.<pid>.txt`` there: the kvroute it ran, then a line per collection (wall time, generation,
the thread's CPU µs in it, objects collected).  ``summarise.py`` adds them up
(docs/benchmarks.md, "Garbage and bookkeeping per request"):

    KVROUTE_GC_PROBE=/tmp/gc PYTHONPATH=src:benchmarks/gc_probe \\
        python benchmarks/bench_router_overhead.py --plain --levels 16 --requests 6000 --rounds 2 \\
        --baseline-src /path/to/other/checkout/src
    python benchmarks/gc_probe/summarise.py /tmp/gc --skip 3
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time


def _install(out_dir: str) -> None:
    rows: list[tuple[float, int, float, int]] = []
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            rows.append((time.time(), info["generation"], time.thread_time() - started[0], info["collected"]))

    def dump() -> None:
        with open(os.path.join(out_dir, f"gc.{os.getpid()}.txt"), "w") as f:
            kvroute = sys.modules.get("kvroute")
            f.write(f"{getattr(kvroute, '__file__', '?')} {sys.argv!r}\n")  # which checkout's router
            f.writelines(f"{t:.3f} {g} {cpu * 1e6:.0f} {n}\n" for t, g, cpu, n in rows)

    gc.callbacks.append(timed)
    atexit.register(dump)


if os.environ.get("KVROUTE_GC_PROBE") and "serve" in sys.argv:
    _install(os.environ["KVROUTE_GC_PROBE"])
