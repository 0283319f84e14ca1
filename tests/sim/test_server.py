"""The simulator over HTTP on loopback: SDKs, streaming, /metrics, errors, faults, answers."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import chat, prose

from kvroute.sim.faults import Fault
from kvroute.sim.server import SimFleet, start_sim_fleet

MODEL = "qwen3-3b"
# The label that tells a family's series apart, where it has several.
DETAIL_LABELS = ("finished_reason", "source", "le")


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    fleet = await start_sim_fleet("dense-3b", 2, speed=100.0, output_tokens_min=8, output_tokens_max=24)
    try:
        yield fleet
    finally:
        await fleet.close()


def oai(url: str, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-sim", max_retries=0, **kw)


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                assert "model_name" not in sample.labels and sample.labels["engine"] == "0"
            elif sample.name.startswith("vllm:"):
                assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
            detail = next((sample.labels[k] for k in DETAIL_LABELS if k in sample.labels), "")
            out[(sample.name, detail)] = sample.value
    return out


async def test_openai_sdk_chat_and_completions_streamed_and_whole(fleet: SimFleet) -> None:
    client = oai(fleet.urls[0])
    messages = chat(prose(300, 1))
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert whole.usage is not None and whole.usage.completion_tokens <= 12
    assert whole.choices[0].message.content and whole.choices[0].finish_reason in ("stop", "length")

    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                                  stream_options={"include_usage": True})
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content        # deterministic output
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens > 0

    done = await client.completions.create(model=MODEL, prompt=prose(100, 2), max_tokens=5)
    assert done.usage is not None and done.usage.completion_tokens == 5
    assert done.choices[0].finish_reason == "length"
    pieces = [c.choices[0].text async for c in
              await client.completions.create(model=MODEL, prompt=prose(100, 2), max_tokens=5, stream=True)
              if c.choices]
    assert "".join(pieces) == done.choices[0].text


async def test_anthropic_sdk_messages_and_event_sequence(fleet: SimFleet,
                                                         http: aiohttp.ClientSession) -> None:
    client = anthropic.AsyncAnthropic(base_url=fleet.urls[0], api_key="sk-sim", max_retries=0)
    body = {"model": MODEL, "max_tokens": 10, "system": "be terse",
            "messages": [{"role": "user", "content": [{"type": "text", "text": prose(200, 3)}]}]}
    message = await client.messages.create(**body)
    assert message.content[0].type == "text" and message.usage.output_tokens <= 10
    async with client.messages.stream(**body) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == message.content[0].text
    assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0

    async with http.post(fleet.urls[0] + "/v1/messages", json={**body, "stream": True}) as resp:
        raw = await resp.text()
    events = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "content_block_start"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


async def test_messages_accept_what_vllm_accepts_from_claude_code(fleet: SimFleet) -> None:
    """Claude Code 2.1.x: a system message after the first user turn, fields vLLM's model does not
    declare (ignored), max_tokens beyond the context (capped), an attribution block per request."""
    client = anthropic.AsyncAnthropic(base_url=fleet.urls[0], api_key="sk-sim", max_retries=0)
    env = prose(1500, 7)

    def system(cch: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332; cch={cch};"},
                {"type": "text", "text": prose(2000, 5), "cache_control": {"type": "ephemeral"}}]
    extra = {"thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
             "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    first = {"role": "user", "content": [{"type": "text", "text": prose(400, 9)}]}

    async def send(cch: str, messages: list[dict[str, Any]]) -> anthropic.types.Message:
        # Claude Code streams; the SDK refuses max_tokens=32000 without streaming.
        async with client.messages.stream(model=MODEL, max_tokens=32000, system=system(cch),  # type: ignore[arg-type]
                                          extra_body=extra, messages=messages) as stream:  # type: ignore[arg-type]
            return await stream.get_final_message()

    one = await send("a1", [first, {"role": "system", "content": [
        {"type": "text", "text": env, "cache_control": {"type": "ephemeral"}}]}])
    reply = one.content[0].text  # type: ignore[union-attr]
    assert reply and one.usage.input_tokens > 900
    two = await send("b2", [first, {"role": "system", "content": env},
                            {"role": "assistant", "content": reply}, {"role": "user", "content": "and now?"},
                            {"role": "system", "content": "a new reminder"}])
    # The second turn renders as the first turn, its reply and more: all of turn 1 is cached
    # (up to the last partial block), although the attribution hash and the system message's
    # shape changed.
    prompt_two = two.usage.input_tokens + (two.usage.cache_read_input_tokens or 0)
    assert (two.usage.cache_read_input_tokens or 0) >= 0.9 * prompt_two


async def test_metrics_parse_and_agree_with_usage(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[1]
    client = oai(url)
    shared = prose(400, 4)
    prompt_tokens = cached = completion = 0
    for i in range(4):
        r = await client.chat.completions.create(model=MODEL, max_tokens=6,
                                                 messages=chat(shared + prose(20 * i + 5, 40 + i)))
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        prompt_tokens += r.usage.prompt_tokens
        completion += r.usage.completion_tokens
        cached += r.usage.prompt_tokens_details.cached_tokens
    m = await metrics(http, url)
    assert m[("vllm:prompt_tokens_total", "")] == prompt_tokens == m[("vllm:prefix_cache_queries_total", "")]
    assert m[("vllm:prefix_cache_hits_total", "")] == cached > 0
    assert m[("vllm:generation_tokens_total", "")] == completion
    assert m[("vllm:prompt_tokens_cached_total", "")] == m[("vllm:prompt_tokens_by_source_total",
                                                             "local_cache_hit")] == cached
    assert m[("vllm:prompt_tokens_by_source_total", "local_compute")] == prompt_tokens - cached
    assert m[("vllm:request_prompt_tokens_sum", "")] == prompt_tokens
    assert m[("vllm:request_prompt_tokens_count", "")] == 4
    assert m[("vllm:request_prompt_tokens_bucket", "+Inf")] == 4
    assert m[("vllm:request_prefill_kv_computed_tokens_sum", "")] == prompt_tokens - cached
    assert m[("vllm:request_generation_tokens_sum", "")] == completion
    assert m[("vllm:time_to_first_token_seconds_count", "")] == 4
    assert m[("vllm:request_queue_time_seconds_count", "")] == 4
    assert m[("vllm:request_success_total", "stop")] + m[("vllm:request_success_total", "length")] == 4
    assert m[("vllm:num_requests_running", "")] == 0 and m[("vllm:kv_cache_usage_perc", "")] == 0
    assert m[("process_start_time_seconds", "")] > 1e9
    assert m[("vllm:prompt_tokens_created", "")] == m[("process_start_time_seconds", "")]
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    info = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info")
    labels = info.samples[0].labels
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "True"
    assert labels["prefix_match_unit"] == "None" and labels["mamba_block_size"] == "None"
    config = fleet.replicas[1].config
    assert labels["kv_cache_size_tokens"] == str(config.num_gpu_blocks * 16)


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/v1/chat/completions", b"{not json", 400, "Invalid JSON"),
    ("/v1/chat/completions", b'{"model": "qwen3-3b"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}', 404,
     "does not exist"),
    ("/v1/completions", b'{"model": "qwen3-3b", "prompt": "' + b"x" * 140_000 + b'", "max_tokens": 4}', 400,
     "maximum context length is 32768 tokens"),
    ("/v1/messages", b'{"model": "qwen3-3b", "max_tokens": 9, "messages": [{"role": "tool", '
     b'"content": "x"}]}', 400, "role must be 'user', 'assistant' or 'system'"),
    ("/v1/messages", b'{"model": "qwen3-3b", "max_tokens": 2000, "thinking": {"type": "enabled", '
     b'"budget_tokens": 4096}, "messages": [{"role": "user", "content": "x"}]}', 400,
     "budget_tokens must be less than max_tokens"),
    ("/v1/messages", b'{"model": "qwen3-3b", "max_tokens": 9, "messages": [{"role": "user", "content": '
     b'[{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}]}]}', 400,
     'only allowed in messages with role "system"'),
    ("/v1/messages", b'{"model": "qwen3-3b", "messages": [{"role": "user", "content": "x"}]}', 400,
     "max_tokens"),
])
async def test_bad_requests_get_vllm_style_errors(fleet: SimFleet, http: aiohttp.ClientSession, path: str,
                                                 body: bytes, status: int, needle: str) -> None:
    async with http.post(fleet.urls[0] + path, data=body,
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        err = await resp.json()
    if path == "/v1/messages":
        assert err["type"] == "error" and needle in err["error"]["message"]
    else:
        assert needle in err["error"]["message"] and err["error"]["code"] in (status, "model_not_found")


async def test_sdk_sees_context_overflow_as_bad_request(fleet: SimFleet) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await oai(fleet.urls[0]).chat.completions.create(model=MODEL, messages=chat(prose(33_000, 5)))


async def test_models_health_server_info_tokenize_render(fleet: SimFleet,
                                                         http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    async with http.get(url + "/v1/models") as resp:
        model = (await resp.json())["data"][0]
    assert model["id"] == MODEL and model["max_model_len"] == 32768
    async with http.get(url + "/health") as resp:
        assert resp.status == 200
    async with http.get(url + "/server_info") as resp:
        info = await resp.json()
    assert info["max_num_seqs"] == 128 and info["enable_prefix_caching"] is True
    assert "enable_prefix_caching=True" in info["vllm_config"]
    assert info["clock"]["speed"] == 100.0 and info["clock"]["dropped_lag_s"] >= 0.0
    messages = chat("hello there")
    async with http.post(url + "/tokenize", json={"model": MODEL, "messages": messages}) as resp:
        tok = await resp.json()
    render_body = {"model": MODEL, "messages": messages}
    async with http.post(url + "/v1/chat/completions/render", json=render_body) as resp:
        rendered = await resp.json()
    assert rendered["token_ids"] == tok["tokens"] and tok["count"] == len(tok["tokens"])
    async with http.post(url + "/detokenize", json={"tokens": tok["tokens"]}) as resp:
        assert (await resp.json())["prompt"].startswith("<|im_start|>user\nhello there")
    usage = (await oai(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)).usage
    assert usage is not None and usage.prompt_tokens == tok["count"]
    async with http.post(url + "/v1/completions/render", json={"model": MODEL, "prompt": "abcdefgh"}) as resp:
        assert (await resp.json())[0]["token_ids"] == [1684234849, 1751606885]


async def test_answer_mode_and_corrupt_replies() -> None:
    async with await start_sim_fleet("dense-3b", 1, speed=100.0, answer_mode=True) as good:
        r = await oai(good.urls[0]).chat.completions.create(
            model=MODEL, messages=chat(prose(200, 6) + " What is 37 * 12?"), max_tokens=20)
        assert r.choices[0].message.content == "444"
    async with await start_sim_fleet("dense-3b", 1, speed=100.0, answer_mode=True, corrupt_rate=1.0) as bad:
        replies = [(await oai(bad.urls[0]).chat.completions.create(
            model=MODEL, messages=chat(f"What is {i} + 1?"), max_tokens=20)).choices[0].message.content
            for i in range(12)]
    assert all(text == "" or set(text) == {"!"} for text in replies)
    assert "" in replies and any(replies)


async def _fault(http: aiohttp.ClientSession, url: str, **body: Any) -> dict[str, Any]:
    async with http.post(url + "/admin/fault", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_error_fault_with_count_then_recovers(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    await _fault(http, url, kind="error", status=503, count=2)
    client = oai(url)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)
    assert (await client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)).choices
    async with http.post(url + "/admin/fault", json={"kind": "explode"}) as resp:
        assert resp.status == 400


async def test_hang_fault_and_client_disconnect_abort(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    await _fault(http, url, kind="hang", count=1)
    with pytest.raises(openai.APITimeoutError):
        await oai(url, timeout=0.5).chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)
    # A long streamed reply, abandoned after its first chunk, leaves the engine.
    engine = fleet.replicas[0].engine
    body = {"model": MODEL, "messages": chat(prose(100, 7)), "max_tokens": 5000, "ignore_eos": True,
            "stream": True}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.content.readline()
        assert engine.snapshot().num_running == 1
    for _ in range(200):
        if not engine.has_work():
            break
        await asyncio.sleep(0.01)
    snap = engine.snapshot()
    assert snap.num_running == 0 and snap.stats.finished == {"abort": 1} and snap.kv_cache_usage == 0


async def _reset_after(port: int, body: bytes, chunks: int) -> None:
    """Read ``chunks`` SSE events of a streamed reply, then reset the connection (RST, no FIN)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    for _ in range(chunks):
        await reader.readuntil(b"\n\n")
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_clients_resetting_streams_are_aborted_without_tracebacks(
        caplog: pytest.LogCaptureFixture) -> None:
    # Many streams reset at random points: some resets are seen by a write rather than a read.
    rng = random.Random(3)
    async with await start_sim_fleet("dense-3b", 1, speed=50.0) as fleet:
        port = int(fleet.urls[0].rsplit(":", 1)[1])
        engine = fleet.replicas[0].engine
        with caplog.at_level(logging.DEBUG):
            for round_ in range(3):
                await asyncio.gather(*(_reset_after(port, orjson.dumps({
                    "model": MODEL, "messages": chat(f"hi {round_} {i}"), "max_tokens": 200,
                    "ignore_eos": True, "stream": True}), rng.randrange(1, 30)) for i in range(25)))
            for _ in range(300):
                if not engine.has_work():
                    break
                await asyncio.sleep(0.01)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    snap = engine.snapshot()
    assert snap.num_running == snap.num_waiting == 0 and snap.stats.finished == {"abort": 75}


async def test_drop_fault_cuts_the_stream(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    await _fault(http, url, kind="drop", after_tokens=3, count=1)
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 20, "ignore_eos": True, "stream": True}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert (await resp.text()).endswith("data: [DONE]\n\n")


async def test_stall_fault_stops_the_stream_and_keeps_the_connection(fleet: SimFleet,
                                                                      http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    await _fault(http, url, kind="stall", after_tokens=3, count=2)
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 20, "ignore_eos": True, "stream": True}
    got = b""
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                async for chunk in resp.content.iter_any():
                    got += chunk
    events = got.split(b"\n\n")[:-1]
    assert len(events) == 4 and all(e.startswith(b"data: {") for e in events)  # the role chunk, 3 tokens
    # A plain answer stalls after half its body.
    async with http.post(url + "/v1/chat/completions", json={**body, "stream": False}) as resp:
        assert resp.status == 200 and resp.content_length
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await resp.read()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert (await resp.text()).endswith("data: [DONE]\n\n")  # the count is spent: it recovered


async def test_garbage_wrong_shape_and_oversized_faults_answer_200_with_no_answer(
        fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 6, "ignore_eos": True}

    async def answer(stream: bool, path: str = "/v1/chat/completions") -> bytes:
        async with http.post(url + path, json={**body, "stream": stream}) as resp:
            assert resp.status == 200
            return await resp.read()

    await _fault(http, url, kind="garbage", after_tokens=0, count=2)
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(await answer(False))
    assert not (await answer(True)).startswith(b"data:")  # not SSE from its first byte
    await _fault(http, url, kind="garbage", after_tokens=2, count=1)
    events = (await answer(True, "/v1/messages")).split(b"\n\n")
    # message_start and content_block_start, two deltas, then one line of garbage; the rest follows.
    assert events[4].startswith(b"\x00\xff")
    assert events[-2] == b'event: message_stop\ndata: {"type":"message_stop"}'
    await _fault(http, url, kind="wrong_shape", count=2)
    doc = orjson.loads(await answer(False))
    assert "choices" not in doc and doc["object"] == "kvroute.sim.wrong_shape"
    assert orjson.loads((await answer(True)).split(b"\n\n")[0][6:]) == doc
    await _fault(http, url, kind="oversized", after_tokens=1, size=300_000, count=1)
    sizes = [len(e) for e in (await answer(True)).split(b"\n\n")]
    assert max(sizes) > 300_000 and sorted(sizes)[-2] < 1000  # one event that large, the rest as usual
    assert orjson.loads(await answer(False))["choices"]  # every fault's count is spent


@pytest.mark.parametrize(("body", "message"), [
    ({"kind": "oversized", "size": 0}, "size must be at least 1 byte"),
    ({"kind": "stall", "after_tokens": -1}, "after_tokens non-negative"),
    ({"kind": "garbage", "depth": 1}, "unknown fault field"),
])
def test_bad_answer_faults_are_rejected(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fault.from_json(body)


async def test_restart_empties_cache_resets_counters_and_changes_start_time(
        fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    client = oai(url)
    messages = chat(prose(500, 8))
    await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    before = await metrics(http, url)
    body = {"model": MODEL, "messages": chat("long"), "max_tokens": 5000, "ignore_eos": True, "stream": True}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            await resp.content.readline()
            assert (await _fault(http, url, kind="restart"))["dropped"] == 1
            await resp.read()                                   # in-flight streams are cut
    after = await metrics(http, url)
    assert after[("process_start_time_seconds", "")] > before[("process_start_time_seconds", "")]
    assert after[("vllm:prompt_tokens_total", "")] == 0
    again = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    await _fault(http, url, kind="restart", down_s=50.0)      # 0.5 s of wall time at speed 100
    async with http.get(url + "/health") as resp:
        assert resp.status == 503


async def test_slow_fault_stretches_latency(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    client = oai(url)

    async def timed(seed: int) -> float:
        start = time.perf_counter()
        await client.chat.completions.create(model=MODEL, messages=chat(prose(4000, seed)), max_tokens=1)
        return time.perf_counter() - start

    normal = await timed(9)
    await _fault(http, url, kind="slow", factor=8.0)
    slow = await timed(10)
    assert slow > 2.5 * normal


async def test_dense_seed_table_over_http() -> None:
    async with await start_sim_fleet("dense-3b", 2, speed=10.0) as fleet:
        a, b = (oai(u) for u in fleet.urls)
        conv = chat(prose(5616, 11))

        async def turn(client: openai.AsyncOpenAI) -> tuple[float, int, str]:
            start = time.perf_counter()
            r = await client.chat.completions.create(model=MODEL, messages=conv, max_tokens=1)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return time.perf_counter() - start, r.usage.prompt_tokens_details.cached_tokens, \
                r.choices[0].message.content or ""

        t1, c1, reply = await turn(a)
        conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": prose(185, 12)}]
        t2, c2, reply = await turn(a)
        conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": prose(185, 13)}]
        t3, c3, _ = await turn(b)
    assert c1 == 0 and c2 > 5600 and c3 == 0
    assert t2 < 0.5 * t1 and t3 > 0.6 * t1


async def test_requests_queue_beyond_max_num_seqs_over_http(http: aiohttp.ClientSession) -> None:
    async with await start_sim_fleet("a4000-qwen3-4b", 1, speed=50.0, max_num_seqs=2) as fleet:
        url = fleet.urls[0]
        client = oai(url)
        tasks = [asyncio.create_task(client.chat.completions.create(
            model="qwen3-4b", messages=chat(prose(50, 20 + i)), max_tokens=40,
            extra_body={"ignore_eos": True}))
            for i in range(6)]
        seen = 0.0
        while not all(t.done() for t in tasks):
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_waiting{"):
                    seen = max(seen, float(line.rsplit(" ", 1)[1]))
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
    assert seen > 0


async def test_restart_with_other_flags_keeps_the_address() -> None:
    async with await start_sim_fleet("a4000-qwen3-4b", 2, speed=50.0) as fleet:
        url, started = fleet.urls[0], fleet.replicas[0].process_start_time
        await asyncio.sleep(0.01)
        new = await fleet.restart_with(0, enable_prefix_caching=False)
        assert fleet.urls[0] == url == new.url and new.process_start_time > started
        async with aiohttp.ClientSession() as http, http.get(url + "/server_info") as resp:
            info = await resp.json()
        assert info["enable_prefix_caching"] is False
        assert info["block_size"] == fleet.replicas[1].config.block_size
