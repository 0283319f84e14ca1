"""`kvroute sim` as a user runs it: a real process serving N replicas."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import orjson

_CMD = [sys.executable, "-c", "from kvroute.cli import main; main()", "sim"]


def test_sim_command_serves_replicas_with_overrides() -> None:
    proc = subprocess.Popen(
        [*_CMD, "--preset", "hybrid-27b", "--replicas", "2", "--port", "0", "--speed", "20",
         "--enable-prefix-caching", "--mamba-cache-mode", "align", "--prefix-match-unit", "32",
         "--cost", "b=0.0003", "--fault", "error:0.5", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        header = proc.stdout.readline()
        assert "2 x hybrid-27b" in header and "block_size=1600" in header
        urls = [proc.stdout.readline().strip() for _ in range(2)]
        assert all(u.startswith("http://127.0.0.1:") for u in urls) and urls[0] != urls[1]
        with urllib.request.urlopen(urls[1] + "/server_info", timeout=10) as resp:
            info = orjson.loads(resp.read())
        assert info["prefix_match_unit"] == 32 and info["mamba_cache_mode"] == "align"
        assert info["cost"]["b"] == 0.0003 and info["faults"][0]["kind"] == "error"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def test_sim_command_reports_vllm_startup_errors() -> None:
    done = subprocess.run([*_CMD, "--preset", "hybrid-27b", "--kv-cache-dtype", "auto", "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "max_num_seqs (128) exceeds available Mamba cache blocks (127)" in done.stderr
