"""What the dispatcher's books cost a small request, in-process: ``admit``, ``route``, ``sent`` and
``finished`` of fresh conversations (a new session each, as the router overhead benchmark sends)
on a virtual clock, flow control at its defaults (``auto``: the gate not engaged), so that the
session book grows as under that load: every session stays ``flow_session_idle_s`` (15 s) after
its answer.  Prints the CPU time per request over a window once the book holds what ``--rate`` x
15 s leaves in it.  ``--src`` runs another checkout's ``src`` in a child process, taking turns
with this one (``--rounds``), so that the machine's other load falls on both alike:

    python benchmarks/bench_dispatch_books.py --src /path/to/base/src --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def measure(rate: float, requests: int, warm: int) -> float:
    """CPU µs per request over ``requests`` requests, after ``warm`` to fill the book."""
    from kvroute.routing.config import ModelSettings, RoutingConfig
    from kvroute.routing.dispatch import Dispatcher
    from kvroute.routing.key import RoutingKey
    from kvroute.routing.scheduler import Scheduler
    from kvroute.routing.worker import WorkerState

    now = [0.0]

    def clock() -> float:
        return now[0]

    cfg = RoutingConfig(default=ModelSettings())
    d = Dispatcher(Scheduler(cfg, clock=clock), timer=clock)
    workers = [WorkerState(f"w{i}", f"http://w{i}", frozenset({"m"}), max_num_seqs=256) for i in range(2)]
    step = 1.0 / rate

    def one(i: int) -> None:
        k = RoutingKey("m", b"request %d: " % i + b"x" * 900, f"s{i}", 250, 16)
        d.admit(k, workers)
        decision = d.route(k, workers)
        state = workers[0] if decision.worker_id == "w0" else workers[1]
        flight, _ = d.sent(k, decision, state)
        now[0] += step
        d.finished(flight, ok=True, prompt_tokens=250, cached_tokens=0, output_tokens=16)

    for i in range(warm):
        one(i)
    start = time.process_time()
    for i in range(warm, warm + requests):
        one(i)
    return (time.process_time() - start) / requests * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=2000.0, help="requests per virtual second (default 2000)")
    p.add_argument("--requests", type=int, default=20_000, help="requests timed per round")
    p.add_argument("--warm", type=int, default=40_000, help="requests before timing (fills the book)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--src", help="also measure this checkout's src, taking turns")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.rate, args.requests, args.warm)))
        return
    targets = {"this": os.path.abspath(_SRC)}
    if args.src:
        targets["other"] = os.path.abspath(args.src)
    out: dict[str, list[float]] = {name: [] for name in targets}
    for r in range(args.rounds):
        order = list(targets) if r % 2 == 0 else list(reversed(targets))
        for name in order:
            env = {**os.environ, "PYTHONPATH": targets[name]}
            res = subprocess.run([sys.executable, __file__, "--child", "--rate", str(args.rate),
                                  "--requests", str(args.requests), "--warm", str(args.warm)],
                                 env=env, check=True, capture_output=True, text=True)
            out[name].append(json.loads(res.stdout))
    for name, values in out.items():
        print(f"{name} ({targets[name]}): µs per request, each round {[round(v, 1) for v in values]}, "
              f"median {statistics.median(values):.1f}")
    if args.src:
        ratios = [a / b for a, b in zip(out["this"], out["other"], strict=True)]
        print(f"this / other, per round: median {statistics.median(ratios):.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
