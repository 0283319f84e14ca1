"""EXPERIMENT (issue 17): raw-socket probes of what each HTTP stack does with the items of issue 17,
out of the box and with the options it offers.  Each server is started fresh in front of simulated
replicas, probed, and stopped (the shutdown probe sends it SIGTERM mid-stream).

    .venv-httplib/bin/python benchmarks/http_stack/probes.py --json /tmp/http_stack_probes.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import launchers  # noqa: E402
from peers.procs import start_sim  # noqa: E402

from kvroute.sync.local_redis import free_port  # noqa: E402

CHAT = orjson.dumps({"model": "qwen3-4b", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
PATH = "/v1/chat/completions"


def post(path: str = PATH, body: bytes = CHAT, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_all(
    s: socket.socket, wait: float = 3.0, limit: int = 1 << 20, total: float | None = None
) -> tuple[bytes, str]:
    """Read until the peer closes, ``wait`` passes with nothing new, ``limit`` bytes, or ``total``
    seconds in all."""
    s.settimeout(wait)
    data = b""
    end = None if total is None else time.monotonic() + total
    try:
        while len(data) < limit and (end is None or time.monotonic() < end):
            chunk = s.recv(65536)
            if not chunk:
                return data, "closed"
            data += chunk
    except TimeoutError:
        return data, "open"
    except ConnectionResetError:
        return data, "reset"
    return data, "open"


def statuses(data: bytes) -> list[str]:
    """Status codes of every response in ``data`` (a pipelined answer may follow a body directly)."""
    return [m.decode() for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", data)]


def summary(data: bytes, state: str) -> str:
    st = statuses(data)
    body = data.split(b"\r\n\r\n", 1)[1][:90] if b"\r\n\r\n" in data else b""
    ctype = ""
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-type:"):
            ctype = line.split(b":", 1)[1].strip().decode()
    return f"{'+'.join(st) or 'no answer'} [{ctype}] {body!r} conn={state}"


def send_and_read(port: int, payload: bytes, wait: float = 3.0) -> str:
    s = connect(port)
    try:
        s.sendall(payload)
    except OSError as exc:
        data, state = read_all(s, wait)
        return summary(data, state) + f" (send failed: {type(exc).__name__})"
    data, state = read_all(s, wait)
    s.close()
    return summary(data, state)


def _rss_mib(pid: int) -> int:
    """Resident memory of ``pid`` and its children (granian's worker), MiB."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/status"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(stat.parent.name) == pid or fields.get("PPid", "").strip() == str(pid):
            total += int(fields.get("VmRSS", "0 kB").split()[0])
    return total >> 10


def probe_flood_header(port: int, pid: int, total: int = 300 << 20, budget_s: float = 30.0) -> str:
    """One header whose value never ends: how much the server takes before answering or closing."""
    s = connect(port, timeout=10)
    s.sendall(f"POST {PATH} HTTP/1.1\r\nHost: x\r\nX-Flood: ".encode())
    sent, chunk = 0, b"a" * (1 << 20)
    t0 = time.monotonic()
    try:
        while sent < total:
            if time.monotonic() - t0 > budget_s:
                data, state = read_all(s, 1)
                return (
                    f"still taking bytes after {sent >> 20} MiB in {budget_s:.0f}s, no answer "
                    f"(server RSS {_rss_mib(pid)} MiB): " + summary(data, state)
                )
            s.sendall(chunk)
            sent += len(chunk)
    except OSError as exc:
        data, state = read_all(s, 2)
        return f"after {sent >> 20} MiB sent ({type(exc).__name__}): " + summary(data, state)
    data, state = read_all(s, 3)
    return f"all {sent >> 20} MiB accepted in {time.monotonic() - t0:.1f}s, then: " + summary(data, state)


def probe_idle(port: int, prefix: bytes, cap: float = 35.0) -> str:
    """Seconds until the server closes a connection that sent ``prefix`` and then nothing."""
    s = connect(port, timeout=cap)
    t0 = time.monotonic()
    if prefix:
        s.sendall(prefix)
    data, state = read_all(s, cap, limit=1 << 24)
    # After a full request, its answer arrives first: keep waiting for the close.
    while state == "open" and time.monotonic() - t0 < cap and data:
        more, state = read_all(s, cap - (time.monotonic() - t0))
        if not more:
            break
        data += more
    took = time.monotonic() - t0
    s.close()
    st = statuses(data)
    return (
        f"closed after {took:.1f}s" if state in ("closed", "reset") else f"still open after {cap:.0f}s"
    ) + (f" (answers: {'+'.join(st)})" if st else "")


def probe_expect(port: int) -> str:
    """Expect: 100-continue with a declared body over 32 MiB: 413 before any body byte?"""
    s = connect(port)
    s.sendall(
        f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Expect: 100-continue\r\nContent-Length: {100 << 20}\r\n\r\n".encode()
    )
    data, state = read_all(s, 3)
    s.close()
    return summary(data, state)


def probe_cap(port: int, holders: int = 64) -> str:
    """``holders`` connections each with a half-sent request, then one complete request."""
    held = []
    for _ in range(holders):
        h = connect(port)
        h.sendall(f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode())
        held.append(h)
    time.sleep(0.5)
    try:
        return send_and_read(port, post(), wait=5)
    finally:
        for h in held:
            h.close()


def probe_shutdown(port: int, pid: int) -> str:
    """A long stream (replicas at --speed 1: minutes of tokens), then SIGTERM to the server: how
    the client's stream ends."""
    body = orjson.dumps(
        {
            "model": "qwen3-4b",
            "stream": True,
            "max_tokens": 20000,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell a long story"}],
        }
    )
    s = connect(port, timeout=30)
    s.sendall(post(body=body))
    first, _ = read_all(s, 1.0)
    os.kill(pid, signal.SIGTERM)
    t0 = time.monotonic()
    rest, state = b"", "open"
    while time.monotonic() - t0 < 40 and state == "open":  # a stream that goes on: stop at 40 s
        more, state = read_all(s, 1.0, limit=1 << 24, total=1.0)
        rest += more
        if state == "open" and not more:
            continue
    took = time.monotonic() - t0
    data = first + rest
    events = [e for e in data.replace(b"\r\n", b"\n").split(b"\n\n") if b"data:" in e]
    last = events[-1][-120:] if events else b""
    terminated = data.endswith(b"0\r\n\r\n")
    return (
        f"{'+'.join(statuses(first)) or 'no answer'}; connection {state} {took:.1f}s after SIGTERM; "
        f"[DONE] seen: {b'[DONE]' in data}; error event: {b'error' in last}; "
        f"ends with chunked terminator: {terminated}; last event {last[-90:]!r}"
    )


PROBES = {
    "request line 70 KB": lambda p, pid: send_and_read(
        p, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
    "one 64 KB header": lambda p, pid: send_and_read(p, post(extra="X-Big: " + "a" * 65536 + "\r\n")),
    "one 1 MB header": lambda p, pid: send_and_read(p, post(extra="X-Big: " + "a" * (1 << 20) + "\r\n")),
    "header flood to 300 MB": probe_flood_header,
    "200 headers": lambda p, pid: send_and_read(p, post(extra="".join(f"X-H{i}: v\r\n" for i in range(200)))),
    "5000 headers": lambda p, pid: send_and_read(
        p, post(extra="".join(f"X-H{i}: v\r\n" for i in range(5000)))
    ),
    "Expect 100-continue + 100 MB length": lambda p, pid: probe_expect(p),
    "Upgrade: h2c": lambda p, pid: send_and_read(
        p,
        post(
            extra="Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
        ),
    ),
    "Upgrade: websocket (POST)": lambda p, pid: send_and_read(
        p, post(extra="Connection: Upgrade\r\nUpgrade: websocket\r\n")
    ),
    "valid + garbage pipelined": lambda p, pid: send_and_read(p, post() + b"GARBAGE\r\n\r\n"),
    "2 valid pipelined": lambda p, pid: send_and_read(p, post() + post()),
    "path /v1/%63hat/completions": lambda p, pid: send_and_read(p, post(path="/v1/%63hat/completions")),
    "path /v1/chat%2Fcompletions": lambda p, pid: send_and_read(p, post(path="/v1/chat%2Fcompletions")),
    "path /v1/%2563hat/completions": lambda p, pid: send_and_read(p, post(path="/v1/%2563hat/completions")),
    "idle connection, no byte": lambda p, pid: probe_idle(p, b""),
    "headers never finished": lambda p, pid: probe_idle(p, f"POST {PATH} HTTP/1.1\r\nHost: x\r\n".encode()),
    "body never finished (10 of 100 B)": lambda p, pid: probe_idle(
        p, f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789".encode()
    ),
    "keep-alive idle after 1 request": lambda p, pid: probe_idle(p, post()),
    "64 half-sent requests held, then 1 more": lambda p, pid: probe_cap(p),
    "SIGTERM during a stream": probe_shutdown,
}


def servers(workers: list[str], log_dir: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    py = sys.executable
    bindir = Path(py).parent
    env = {"HTTPSTACK_WORKERS": ",".join(workers)}
    kv = [py, "-c", "from kvroute.cli import main; main()", "serve", "--host", "127.0.0.1",
          "--port", "{port}", "--log-level", "warning"]
    for w in workers:
        kv += ["--worker", w]
    gr = launchers.granian(bindir, "{port}")
    uv = launchers.uvicorn(bindir, "{port}")
    return {
        "kvroute serve": (kv, {}),
        "granian default": ([*gr, launchers.APP], env),
        "granian configured": (
            [
                *gr,
                "--http1-buffer-size",
                "65536",
                "--http1-header-read-timeout",
                "10000",
                "--backpressure",
                "32",
                "--workers-kill-timeout",
                "5",
                launchers.APP,
            ],
            env,
        ),
        "uvicorn default": ([*uv, launchers.APP], env),
        "uvicorn configured": (
            [
                *uv,
                "--limit-concurrency",
                "32",
                "--timeout-keep-alive",
                "5",
                "--timeout-graceful-shutdown",
                "5",
                launchers.APP,
            ],
            env,
        ),
    }


def wait_up(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if "200" in send_and_read(port, post(), wait=2).split(" ")[0]:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server on {port} not up")


async def start_fleet(log_dir: Path) -> tuple[object, list[str]]:
    return await start_sim(log_dir, "a4000-qwen3-4b", 2, 100.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated server names")
    ap.add_argument("--probes", default="", help="semicolon-separated probe names (default all)")
    ap.add_argument("--logs", default="/tmp/http_stack_probe_logs")
    ap.add_argument("--json")
    a = ap.parse_args()
    log_dir = Path(a.logs)
    log_dir.mkdir(parents=True, exist_ok=True)
    loop = asyncio.new_event_loop()
    sim, workers = loop.run_until_complete(start_fleet(log_dir))
    slow, slow_workers = loop.run_until_complete(start_sim(log_dir / "slow", "a4000-qwen3-4b", 1, 1.0))
    results: dict[str, dict[str, str]] = {}
    try:
        slow_servers = servers(slow_workers, log_dir)
        for name, (argv, env) in servers(workers, log_dir).items():
            if a.only and name not in a.only.split(","):
                continue
            results[name] = {}
            for probe, fn in PROBES.items():
                if a.probes and probe not in a.probes.split(";"):
                    continue
                run_argv, run_env = slow_servers[name] if fn is probe_shutdown else (argv, env)
                port = free_port()
                log = (log_dir / f"{name.replace(' ', '_')}.log").open("ab")
                proc = subprocess.Popen(
                    [x.replace("{port}", str(port)) for x in run_argv],
                    stdout=log,
                    stderr=log,
                    env={**os.environ, **run_env},
                )
                try:
                    wait_up(port)
                    try:
                        out = fn(port, proc.pid)
                    except Exception as exc:  # a probe that breaks is a result too
                        out = f"probe error {type(exc).__name__}: {exc}"
                finally:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                results[name][probe] = out
                print(f"{name:<20} {probe:<38} {out}", flush=True)
    finally:
        loop.run_until_complete(sim.stop())  # type: ignore[attr-defined]
        loop.run_until_complete(slow.stop())  # type: ignore[attr-defined]
    if a.json:
        Path(a.json).write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
