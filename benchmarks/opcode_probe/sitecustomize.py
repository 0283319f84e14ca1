"""Counts the bytecodes a ``kvroute serve`` process executes, by function: put this directory on
the router's ``PYTHONPATH`` and set ``KVROUTE_OPCODE_PROBE`` to a directory; ``SIGUSR1`` starts
counting (on the event loop's thread), ``SIGUSR2`` stops and writes ``opcodes.<pid>.txt`` there: a
line per function with the bytecodes it ran itself, those run while it was on the stack
(inclusive) and its calls (a coroutine's every resumption counts as one).  Counted, not sampled:
the machine's load changes only what runs by the clock (probes, the canary, the saturation read
every 0.25 s), which tracing, slowing the router ~10-20x, inflates per request.  It sees
interpreted Python only (a C function's work, orjson's or a socket write's, counts as the one
bytecode that called it).  ``run.py`` drives it
(docs/benchmarks.md, "2026-12-07: instructions per request").
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from types import CodeType, FrameType
from typing import Any


def _install(out_dir: str) -> None:
    own: Counter[CodeType] = Counter()
    under: Counter[CodeType] = Counter()
    calls: Counter[CodeType] = Counter()
    total = [0]
    # Bytecodes run so far when each traced frame was entered or resumed: what ran until it
    # returned or yielded is its inclusive count (a coroutine's every step adds its part).
    entered: dict[FrameType, int] = {}

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            own[frame.f_code] += 1
            total[0] += 1
        elif event == "return":
            start = entered.pop(frame, None)
            if start is not None:
                under[frame.f_code] += total[0] - start
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        calls[frame.f_code] += 1
        entered[frame] = total[0]
        frame.f_trace_opcodes = True
        return local

    def start(signum: int, _: Any) -> None:
        own.clear(), under.clear(), calls.clear(), entered.clear()
        sys.settrace(on_call)

    def stop(signum: int, _: Any) -> None:
        sys.settrace(None)
        with open(os.path.join(out_dir, f"opcodes.{os.getpid()}.txt"), "w") as f:
            for code in (own | under | calls):
                n = under[code]
                where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:{code.co_qualname}"
                f.write(f"{own[code]} {n} {calls[code]} {where}\n")

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


if os.environ.get("KVROUTE_OPCODE_PROBE") and "serve" in sys.argv:
    _install(os.environ["KVROUTE_OPCODE_PROBE"])
