"""`kvroute sim` as a user runs it: a real process serving N replicas."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import orjson
import zmq

from kvroute.fleet.kv_event_wire import Stored, decode_batch, parse_pub_frames

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


def test_sim_command_publishes_kv_events_per_rank() -> None:
    config = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
              '"replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv", "buffer_steps": 50}')
    proc = subprocess.Popen(
        [*_CMD, "--preset", "dense-3b", "--replicas", "2", "--port", "0", "--speed", "100",
         "--kv-events-config", config, "--kv-events-encoding", "array", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    ctx = zmq.Context()
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        urls = [proc.stdout.readline().strip() for _ in range(2)]
        ranks = [proc.stdout.readline().strip() for _ in range(2)]
        assert ranks[1].startswith("kv events of rank 1: tcp://127.0.0.1:")
        assert "(array, topic 'kv')" in ranks[1]
        with urllib.request.urlopen(urls[1] + "/server_info", timeout=10) as resp:
            info = orjson.loads(resp.read())["kv_events"]
        assert (info["data_parallel_rank"], info["encoding"], info["buffer_steps"]) == (1, "array", 50)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(info["endpoint"])
        assert not sub.poll(300)                     # the subscription reaches the publisher
        body = orjson.dumps({"messages": [{"role": "user", "content": "hello " * 60}], "max_tokens": 4})
        req = urllib.request.Request(urls[1] + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        assert sub.poll(10_000)
        topic, seq, payload = parse_pub_frames(sub.recv_multipart())
        batch = decode_batch(payload)
        assert (topic, seq, batch.data_parallel_rank) == (b"kv", 0, 1)
        assert isinstance(batch.events[0], Stored)
    finally:
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def test_sim_command_refuses_a_bad_kv_events_config() -> None:
    for args, message in (
        (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'], "publisher"),
        (["--kv-events-config", "{not json"], "not valid JSON"),
        (["--kv-events-encoding", "json"], "map, array"),
    ):
        done = subprocess.run([*_CMD, "--port", "0", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr
