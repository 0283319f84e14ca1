"""EXPERIMENT (issue 17): router CPU per request and requests/s of kvroute's hand-written front
(``kvroute serve``) against the same routing path served by granian and by uvicorn
(``asgi_router.py``), 64 closed-loop clients, small chat requests, non-streaming and streaming.

All three routers run at once in front of one set of simulated replicas (``peers.simfleet``,
``--speed 100``); targets take turns in short windows, round after round, the order reversed every
other round (as in ``benchmarks/peers.py``'s router-cost part, whose load generator this reuses).
Router CPU is read from /proc for the router's process tree (granian's worker included).

    .venv-httplib/bin/python benchmarks/http_stack/bench.py --rounds 6 --json /tmp/http_stack.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/, for peers.*

import launchers  # noqa: E402
from peers.cost import CostPlan, run_cost  # noqa: E402
from peers.procs import Proc, start_sim, wait_serving  # noqa: E402
from peers.routers import Launch  # noqa: E402

from kvroute.sync.local_redis import free_port  # noqa: E402

MODEL = "qwen3-4b"


def launches(
    workers: list[str], which: list[str], log_dir: Path, lean: bool = False
) -> dict[str, tuple[Launch, dict[str, str]]]:
    py = sys.executable
    bindir = Path(py).parent
    env = {
        "HTTPSTACK_WORKERS": ",".join(workers),
        "HTTPSTACK_PROBE_INTERVAL_S": "1.0",
        "HTTPSTACK_LEAN": "1" if lean else "0",
    }
    tag = ", lean" if lean else ""
    out: dict[str, tuple[Launch, dict[str, str]]] = {}
    if "kvroute" in which:
        port = free_port()
        cfg = log_dir / "kvroute.toml"
        cfg.write_text("probe_interval_s = 1.0\n")
        argv = [
            py,
            "-c",
            "from kvroute.cli import main; main()",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--config",
            str(cfg),
            "--log-level",
            "warning",
        ]
        for w in workers:
            argv += ["--worker", w]
        out["kvroute serve (hand-written front)"] = (Launch(tuple(argv), f"http://127.0.0.1:{port}"), {})
    if "granian" in which:
        port = free_port()
        argv = [*launchers.granian(bindir, str(port)), launchers.APP]
        out[f"granian 2.8.9 (ASGI prototype{tag})"] = (Launch(tuple(argv), f"http://127.0.0.1:{port}"), env)
    if "uvicorn" in which:
        port = free_port()
        argv = [*launchers.uvicorn(bindir, str(port)), launchers.APP]
        out[f"uvicorn 0.54 httptools (ASGI prototype{tag})"] = (
            Launch(tuple(argv), f"http://127.0.0.1:{port}"),
            env,
        )
    return out


async def main(a: argparse.Namespace) -> None:
    log_dir = Path(a.logs)
    sim, urls = await start_sim(log_dir, "a4000-qwen3-4b", a.replicas, a.speed)
    procs: list[tuple[str, Launch, Proc]] = []
    try:
        for label, (launch, env) in launches(urls, a.targets.split(","), log_dir, a.lean).items():
            proc = await Proc.start(label.split()[0], launch.argv, log_dir, env=env)
            procs.append((label, launch, proc))
        for _label, launch, proc in procs:
            await wait_serving(launch, proc, MODEL)
        plan = CostPlan(clients=a.clients, duration_s=a.seconds, warmup_s=a.warmup)
        rounds: list[list[dict[str, object]]] = []
        for r in range(a.rounds):
            order = procs if r % 2 == 0 else procs[::-1]
            one = []
            for label, launch, proc in order:
                for stream in (False, True):
                    res = await run_cost(
                        label, [launch.url], MODEL, plan, stream=stream, meters={"router": [proc.process.pid]}
                    )
                    cpu = res.cpu_ms_per_request("router")
                    print(
                        f"round {r + 1} {label:<42} {'stream' if stream else 'whole ':<6} "
                        f"{res.requests_per_s:7.0f} req/s  p50 {res.p50_ms or 0:6.1f} ms  "
                        f"cpu {cpu or 0:.3f} ms/req  errors {res.errors} {res.first_error or ''}",
                        flush=True,
                    )
                    one.append(
                        {
                            "label": label,
                            "stream": stream,
                            "rps": res.requests_per_s,
                            "p50_ms": res.p50_ms,
                            "p99_ms": res.p99_ms,
                            "requests": res.requests,
                            "errors": res.errors,
                            "router_cpu_s": res.cpu_s.get("router"),
                            "first_error": res.first_error,
                        }
                    )
            rounds.append(one)
        summarise(rounds, procs[0][0])
        if a.json:
            Path(a.json).write_bytes(orjson.dumps({"rounds": rounds}, option=orjson.OPT_INDENT_2))
    finally:
        for _, _, proc in procs:
            with contextlib.suppress(Exception):
                await proc.stop()
        await sim.stop()


def summarise(rounds: list[list[dict[str, object]]], base: str) -> None:
    """Per target and mode: pooled CPU per request, median req/s; per round, ratio to ``base``."""
    print(
        "\n| target | mode | req/s (median) | router CPU ms/req (pooled) | CPU ratio to kvroute, per round (min–median–max) | req/s ratio (median) | errors |"  # noqa: E501
    )
    print("|---|---|---:|---:|---|---:|---:|")
    for stream in (False, True):
        labels = [x["label"] for x in rounds[0] if x["stream"] == stream]
        for label in labels:
            rows = [x for one in rounds for x in one if x["label"] == label and x["stream"] == stream]
            bases = [x for one in rounds for x in one if x["label"] == base and x["stream"] == stream]
            cpu = (
                1000
                * sum(float(x["router_cpu_s"]) for x in rows)
                / max(1, sum(int(x["requests"]) for x in rows))
            )
            ratios = [
                (float(x["router_cpu_s"]) / int(x["requests"]))
                / (float(b["router_cpu_s"]) / int(b["requests"]))
                for x, b in zip(rows, bases, strict=False)
            ]
            rps_ratios = [float(x["rps"]) / float(b["rps"]) for x, b in zip(rows, bases, strict=False)]
            rps = statistics.median(float(x["rps"]) for x in rows)
            print(
                f"| {label} | {'stream' if stream else 'whole'} | {rps:,.0f} "
                f"| {cpu:.3f} | {min(ratios):.2f}–{statistics.median(ratios):.2f}–{max(ratios):.2f} "
                f"| {statistics.median(rps_ratios):.2f} | {sum(int(x['errors']) for x in rows)} |"
            )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="kvroute,granian,uvicorn")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--speed", type=float, default=100.0)
    p.add_argument("--logs", default="/tmp/http_stack_logs")
    p.add_argument("--json")
    p.add_argument(
        "--lean",
        action="store_true",
        help="ASGI prototypes without the disconnect watcher (lower bound of the adapter's cost)",
    )
    args = p.parse_args()
    from kvroute.event_loop import run_event_loop

    run_event_loop(main(args))
