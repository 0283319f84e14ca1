"""``kvroute serve`` as users run it: a separate process, SIGTERM finishing streams in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import aiohttp
from serve_process import wait_ready

SERVE = [sys.executable, "-c", "from kvroute.cli import main; main()", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_serve_routes_and_shuts_down_gracefully_on_sigterm(sim_fleet, tmp_path):
    fleet = await sim_fleet(2)
    port = free_port()
    config = tmp_path / "kvroute.toml"
    config.write_text('retries = 1\n[models."qwen3-4b"]\npolicy = "session"\noverflow = 4\n')
    args = [*SERVE, "--config", str(config), "--port", str(port), "--log-level", "warning"]
    for url in fleet.urls:
        args += ["--worker", url]
    proc = await asyncio.create_subprocess_exec(*args, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, proc)
            body = {"model": "qwen3-4b", "max_tokens": 600, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": "count to a thousand " * 20}]}
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-worker"]
                first = await resp.content.readany()
                proc.send_signal(signal.SIGTERM)
                rest = await resp.read()
        assert (first + rest).endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_serve_rejects_bad_settings_with_a_clear_message(tmp_path):
    wide = {**os.environ, "COLUMNS": "200"}  # error panels wrap at the terminal width
    done = subprocess.run([*SERVE, "--worker", "10.0.0.1:8000"], capture_output=True, text=True, timeout=60,
                          env=wide)
    assert done.returncode == 2
    assert "worker url must start with http:// or https://" in done.stderr
    done = subprocess.run(SERVE, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "200"})
    assert done.returncode == 2
    assert "no workers" in done.stderr
