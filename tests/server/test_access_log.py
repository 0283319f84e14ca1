"""The access log (``access_log``, ``--access-log``) and JSON log lines (``--log-format json``):
one line per inference request with what an operator asks of it, never the prompt."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys

import aiohttp
import anthropic
import openai
import orjson
from serve_process import wait_ready

MODEL = "qwen3-4b"
SECRET = "the-prompt-text-never-logged"
PROMPT = f"{SECRET} tell me about prefix caching. " * 30
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
FIELDS = {"method", "route", "model", "status", "worker", "ttft_s", "prompt_tokens", "cached_tokens",
          "output_tokens", "duration_s", "attempts", "queued_s", "trace_id"}


def access_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvroute.access"]


async def test_one_line_per_request_with_status_worker_timings_and_tokens(sim_fleet, router, caplog):
    fleet = await sim_fleet(2)
    r = await router(fleet.urls, access_log=True)
    caplog.set_level(logging.INFO)
    worker_ids = {rec.id for rec in r.registry.records()}
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=8, extra_headers={"traceparent": TRACEPARENT})
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, stream=True,
            stream_options={"include_usage": True})
        _ = [chunk async for chunk in stream]
        with contextlib.suppress(openai.NotFoundError):
            await client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    claude = anthropic.AsyncAnthropic(base_url=r.url, api_key="k", max_retries=0)
    async with claude:
        await claude.messages.create(model=MODEL, max_tokens=8,
                                     messages=[{"role": "user", "content": PROMPT}])
    async with aiohttp.ClientSession() as http, http.post(r.url + "/v1/completions", data=b"{nope") as resp:
        assert resp.status == 400
    records = access_records(caplog)
    assert len(records) == 5
    plain, streamed, missing, messages, broken = (r.fields for r in records)  # type: ignore[attr-defined]
    for fields in (plain, streamed, missing, messages, broken):
        assert set(fields) == FIELDS and fields["method"] == "POST"
    assert plain["route"] == "/v1/chat/completions" and plain["status"] == 200 and plain["model"] == MODEL
    assert plain["worker"] in worker_ids and plain["attempts"] == 1
    assert plain["prompt_tokens"] > 200 and plain["output_tokens"] == 8
    assert 0 < plain["ttft_s"] <= plain["duration_s"]
    assert plain["trace_id"] == TRACEPARENT.split("-")[1]
    # The second identical prompt went where the first left its prefix, and the usage says so.
    assert streamed["worker"] == plain["worker"] and streamed["cached_tokens"] > 0
    assert streamed["output_tokens"] == 8 and streamed["trace_id"] is None
    assert missing["status"] == 404 and missing["worker"] is None and missing["model"] == "missing"
    assert messages["route"] == "/v1/messages" and messages["status"] == 200
    assert messages["output_tokens"] == 8
    assert broken["route"] == "/v1/completions" and broken["status"] == 400 and broken["model"] is None
    text = records[0].getMessage()
    assert text.startswith(f"POST /v1/chat/completions 200 model={MODEL} worker={plain['worker']} ttft=")
    assert f"tokens_in={plain['prompt_tokens']} cached=" in text and f"trace={plain['trace_id']}" in text
    for record in records:
        assert SECRET not in record.getMessage() and SECRET not in str(record.fields)  # type: ignore[attr-defined]


async def test_no_access_log_unless_asked(echo_engines, router, caplog, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    caplog.set_level(logging.DEBUG)
    async with http.post(r.url + "/v1/chat/completions",
                         json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200
    assert access_records(caplog) == []
    assert r.router.trails is None  # nothing on the hot path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_serve_writes_json_lines_with_the_access_fields_as_keys(sim_fleet):
    fleet = await sim_fleet(1)
    port = free_port()
    args = [sys.executable, "-c", "from kvroute.cli import main; main()", "serve", "--worker", fleet.urls[0],
            "--port", str(port), "--access-log", "--log-format", "json", "--log-level", "info"]
    proc = await asyncio.create_subprocess_exec(*args, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, proc)
            body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": PROMPT}]}
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert proc.stderr is not None
        lines = (await proc.stderr.read()).decode().splitlines()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    docs = [orjson.loads(line) for line in lines]  # every line is one JSON object
    assert all({"ts", "level", "logger", "msg"} <= set(d) for d in docs)
    assert all(d["ts"].endswith("Z") and "T" in d["ts"] for d in docs)
    assert any(d["logger"] == "kvroute.server" and d["msg"].startswith("kvroute listening") for d in docs)
    [access] = [d for d in docs if d["logger"] == "kvroute.access"]
    assert set(access) >= FIELDS and access["level"] == "INFO"
    assert access["status"] == 200 and access["model"] == MODEL and access["output_tokens"] == 5
    assert access["route"] == "/v1/chat/completions" and access["worker"] == fleet.urls[0].split("//")[1]
    assert SECRET not in "\n".join(lines)
