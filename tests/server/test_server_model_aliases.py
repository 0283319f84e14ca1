"""Model aliases and the default model through a real router: real SDKs, simulated replicas (which
answer 404 for a model they do not serve, so a 200 proves the worker got the target's name) and
the echo engine (which shows the bytes it received)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys

import anthropic
import openai
import orjson
import pytest
from serve_process import wait_ready

from kvroute.router_settings import Settings, SettingsError
from kvroute.server.model_names import AnswerRename, UnknownModelLog

MODEL = "qwen3-4b"
ASKED = "claude-sonnet-4-5-20250929"
PROMPT = "Tell me about prefix caching. " * 40
CLAUDE = {"claude-*": MODEL}


async def test_anthropic_sdk_asks_for_a_claude_name_and_gets_it_back(sim_fleet, router) -> None:
    fleet = await sim_fleet(2)
    r = await router(fleet.urls, aliases=CLAUDE)
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with client:
        messages = [{"role": "user", "content": PROMPT}]
        done = await client.messages.create(model=ASKED, max_tokens=12, messages=messages)
        assert done.model == ASKED and done.content[0].text
        direct = await client.messages.create(model=MODEL, max_tokens=12, messages=messages)
        assert direct.model == MODEL and direct.content[0].text == done.content[0].text
        async with client.messages.stream(model="claude-haiku-4-5", max_tokens=12,
                                          messages=messages) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
        assert final.model == "claude-haiku-4-5" and final.content[0].text == done.content[0].text
        assert [e.message.model for e in events if e.type == "message_start"] == ["claude-haiku-4-5"]
    recent = list(r.router.activity.requests)
    assert [(x.model, x.status) for x in recent] == [(MODEL, 200)] * 3
    # The aliased and the direct request share one prefix cache: the second was a prefix hit.
    assert recent[1].worker == recent[0].worker


async def test_openai_sdk_every_streamed_chunk_names_the_model_asked_for(sim_fleet, router) -> None:
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, aliases={"gpt-4o": MODEL, "gpt-*": "elsewhere"})
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        messages = [{"role": "user", "content": PROMPT}]
        done = await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=12)
        assert done.model == "gpt-4o" and done.choices[0].message.content
        stream = await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=12,
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert len(chunks) > 5 and {c.model for c in chunks} == {"gpt-4o"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            done.choices[0].message.content
        legacy = await client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=5)
        assert legacy.model == "gpt-4o"
        # The exact alias won over the glob listed after it; a name only the glob maps goes to a
        # model nothing serves: the API's 404, naming both.
        with pytest.raises(openai.NotFoundError, match=r"`gpt-5` \(mapped to `elsewhere`\).*`qwen3-4b`"):
            await client.chat.completions.create(model="gpt-5", messages=messages, max_tokens=5)


async def test_what_the_worker_receives_and_every_route_renamed(echo_engines, router, http) -> None:
    [engine] = await echo_engines(model=MODEL, events=40)
    r = await router([engine.url], aliases=CLAUDE)
    paths = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/responses", "/v1/embeddings")
    for path in paths:
        body = {"model": ASKED, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                "prompt": "hi", "input": "hi", "temperature": 0.5, "x": "é\u2028"}
        async with http.post(r.url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            raw = await resp.read()
            assert resp.headers["content-length"] == str(len(raw))  # whole, in one write
        # Every answer that names a model names the one asked for (count_tokens names none).
        assert orjson.loads(raw).get("model", ASKED) == ASKED and MODEL.encode() not in raw, (path, raw)
        sent = orjson.loads(engine.seen[-1].body)
        assert sent == {**body, "model": MODEL}, path  # only the model changed
        if path in ("/v1/embeddings", "/v1/messages/count_tokens"):
            continue  # these answer whole: a stream there is not the API's answer (a 502)
        async with http.post(r.url + path, json={**body, "stream": True}) as resp:
            assert resp.status == 200
            streamed = await resp.read()
        assert streamed.count(f'"model":"{ASKED}"'.encode()) >= 1 and MODEL.encode() not in streamed, path
    # Chat chunks each name the model: 40 text events and the usage chunk.
    chat = {"model": ASKED, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with http.post(r.url + "/v1/chat/completions", json=chat) as resp:
        assert (await resp.read()).count(f'"model":"{ASKED}"'.encode()) == 41


async def test_without_an_alias_the_answer_is_relayed_untouched(echo_engines, router, http) -> None:
    [engine] = await echo_engines(model=MODEL)
    r = await router([engine.url], aliases=CLAUDE)
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    async with http.post(r.url + "/v1/chat/completions", data=body,
                         headers={"content-type": "application/json"}) as resp:
        assert resp.headers["content-length"] == str(len(await resp.read()))
    assert engine.seen[-1].body == body  # the very bytes the client sent


async def test_a_served_name_is_not_taken_by_a_catch_all_and_the_default_takes_the_rest(
        echo_engines, router) -> None:
    a, b = await echo_engines(2)
    a.model, b.model = "model-a", "model-b"
    r = await router([a.url, b.url], aliases={"*": "model-a", "small": "model-b"}, default_model="model-b")
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    async with client:
        for _ in range(50):  # the first probe has to learn each worker's model
            if all(s.models for s in r.registry.states()):
                break
            await asyncio.sleep(0.05)
        for asked, worker in (("model-b", b), ("claude-x", a), ("small", b), ("model-a", a)):
            before = len(worker.seen)
            done = await client.chat.completions.create(model=asked, messages=messages)
            assert done.model == asked and len(worker.seen) == before + 1, asked


async def test_the_default_model_alone_serves_claude_code_names(sim_fleet, router) -> None:
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, default_model=MODEL)
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with client:
        done = await client.messages.create(model="claude-opus-4-1", max_tokens=5,
                                            messages=[{"role": "user", "content": PROMPT}])
    assert done.model == "claude-opus-4-1"


async def test_per_model_settings_are_the_target_models(sim_fleet, router) -> None:
    fleet = await sim_fleet(2)
    r = await router(fleet.urls, aliases=CLAUDE, models={MODEL: {"policy": "round-robin"}})
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with client:
        for _ in range(2):
            await client.messages.create(model=ASKED, max_tokens=5,
                                         messages=[{"role": "user", "content": PROMPT}])
    recent = list(r.router.activity.requests)
    assert [x.kind for x in recent] == ["balance", "balance"]  # round-robin's, not auto's
    assert recent[0].worker != recent[1].worker


async def test_unknown_model_404_lists_the_served_models_and_is_logged_rate_limited(
        sim_fleet, router, caplog) -> None:
    fleet = await sim_fleet(1)
    r = await router(fleet.urls)
    secret = "the prompt text that must never be logged"
    caplog.set_level(logging.WARNING, logger="kvroute.proxy")
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with client:
        for _ in range(3):
            with pytest.raises(anthropic.NotFoundError) as caught:
                await client.messages.create(model="claude-opus-4-1", max_tokens=5,
                                             messages=[{"role": "user", "content": secret}])
    error = caught.value.body["error"]
    assert error["type"] == "not_found_error"
    assert error["message"] == ("The model `claude-opus-4-1` does not exist. This router serves: `qwen3-4b` "
                                "(GET /v1/models).")
    lines = [rec.getMessage() for rec in caplog.records if "unknown model" in rec.getMessage()]
    assert len(lines) == 1, lines  # the next two within the interval are counted, not logged
    assert "'claude-opus-4-1'" in lines[0] and "served: qwen3-4b" in lines[0] and "/v1/messages" in lines[0]
    assert secret not in caplog.text


def test_the_unknown_model_log_counts_what_it_did_not_write(caplog) -> None:
    now = [0.0]
    log = UnknownModelLog(logging.getLogger("kvroute.test"), interval_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="kvroute.test")
    for t in (0.0, 1.0, 2.0, 10.5):
        now[0] = t
        log.unknown("/v1/chat/completions", "x" * 500, "x" * 500, ["m"])
    assert len(caplog.records) == 2
    assert "2 more such requests" in caplog.records[1].getMessage()
    assert "x" * 101 not in caplog.text  # a client's name is shortened


async def test_models_list_the_exact_aliases_of_served_models(sim_fleet, router, http) -> None:
    fleet = await sim_fleet(1)
    aliases = {"claude-*": MODEL, "gpt-4o": MODEL, "gone": "not-served"}
    r = await router(fleet.urls, aliases=aliases, default_model=MODEL)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL, "gpt-4o"]
    alias = models.data[1].model_dump()
    served = models.data[0].model_dump()
    assert alias["parent"] == MODEL and alias["owned_by"] == "kvroute"
    assert alias["max_model_len"] == served["max_model_len"] and alias["root"] == served["root"]
    async with http.get(r.url + "/v1/models") as resp:
        doc = await resp.json()
    assert doc["aliases"] == aliases and doc["default_model"] == MODEL
    assert list(doc["aliases"]) == list(aliases)  # the order they are tried in
    async with anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0) as claude:
        page = await claude.models.list()
    assert [(m.id, m.display_name) for m in page.data] == [(MODEL, MODEL),
                                                           ("gpt-4o", "gpt-4o (alias of qwen3-4b)")]


async def test_without_aliases_the_models_list_is_unchanged(sim_fleet, router, http) -> None:
    fleet = await sim_fleet(1)
    r = await router(fleet.urls)
    async with http.get(r.url + "/v1/models") as resp:
        doc = await resp.json()
    assert set(doc) == {"object", "data"} and [m["id"] for m in doc["data"]] == [MODEL]


async def test_a_body_too_deep_to_re_encode_is_a_400_naming_the_field(echo_engines, router, http) -> None:
    [engine] = await echo_engines(model=MODEL)
    r = await router([engine.url], aliases=CLAUDE)
    # orjson reads 300 levels but writes at most 254, and parse_request never renders metadata;
    # "model" in the middle of the body is re-encoded, not spliced.
    deep = "[" * 300 + '"x"' + "]" * 300
    body = (f'{{"messages":[{{"role":"user","content":"hi"}}],"model":"{ASKED}","metadata":{{"deep":{deep}}},'
            '"stream":false}').encode()
    async with http.post(r.url + "/v1/chat/completions", data=body,
                         headers={"content-type": "application/json"}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"].startswith("metadata.deep") and "nested more than 254 levels" in error["message"]
    assert not engine.seen


def test_answer_rename_only_touches_model_fields_naming_the_target() -> None:
    rename = AnswerRename("claude-x", "qwen3-4b")
    events = (b'data: {"id":"c","model":"qwen3-4b",'
              b'"choices":[{"delta":{"content":"\\"model\\":\\"qwen3-4b\\""}}]}'
              b'\n\nevent: message_start\ndata: {"message": {"model": "qwen3-4b"}}\n\n'
              b'data: {"model":"qwen3-4b-other"}\n\n')
    assert rename.events(events) == (
        b'data: {"id":"c","model":"claude-x","choices":[{"delta":{"content":"\\"model\\":\\"qwen3-4b\\""}}]}'
        b'\n\nevent: message_start\ndata: {"message": {"model": "claude-x"}}\n\n'
        b'data: {"model":"qwen3-4b-other"}\n\n')
    body = b'{"model":"qwen3-4b","content":[{"type":"tool_use","input":{"model":"qwen3-4b"}}]}'
    assert orjson.loads(rename.document(body)) == {
        "model": "claude-x", "content": [{"type": "tool_use", "input": {"model": "qwen3-4b"}}]}
    for untouched in (b'{"error":{"message":"bad"}}', b"not json", b'{"model":"other"}', b"[1]"):
        assert rename.document(untouched) == untouched
    quoted = AnswerRename('a"b', "m\\n")
    assert quoted.events(b'data: {"model":"m\\\\n"}\n\n') == b'data: {"model":"a\\"b"}\n\n'


def test_aliases_from_the_file_the_environment_and_flags(tmp_path) -> None:
    config = tmp_path / "kvroute.toml"
    config.write_text('default_model = "qwen3-4b"\n[aliases]\n"claude-haiku-*" = "small"\n'
                      '"claude-*" = "qwen3-4b"\n"gpt-4o" = "qwen3-4b"\n')
    s = Settings.load(config, env={})
    assert list(s.aliases.items()) == [("claude-haiku-*", "small"), ("claude-*", "qwen3-4b"),
                                       ("gpt-4o", "qwen3-4b")]
    assert s.default_model == "qwen3-4b"
    env = {"KVROUTE_ALIASES": "claude-*=a, gpt-*=b", "KVROUTE_DEFAULT_MODEL": ""}
    s = Settings.load(config, env=env)
    assert dict(s.aliases) == {"claude-*": "a", "gpt-*": "b"} and s.default_model is None
    s = Settings.load(config, env=env, overrides={"aliases": ["claude-*=c"], "default_model": "d"})
    assert dict(s.aliases) == {"claude-*": "c"} and s.default_model == "d"
    # What a multi-process router hands each process (asdict, JSON) reads back the same.
    from dataclasses import asdict
    assert Settings.from_dict(orjson.loads(orjson.dumps(asdict(s)))) == s


@pytest.mark.parametrize(("raw", "message"), [
    ({"aliases": ["claude-*"]}, "PATTERN=MODEL"),
    ({"aliases": {"claude-*": "qwen-*"}}, "not a pattern"),
    ({"aliases": {"claude-*": 3}}, "maps a pattern to a model name"),
    ({"aliases": "claude-*=m"}, "aliases must be a table"),
    ({"default_model": 3}, "default_model must be a string"),
])
def test_bad_aliases_are_named(raw, message) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_dict(raw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_kvroute_serve_flags(sim_fleet, http) -> None:
    fleet = await sim_fleet(1)
    port = _free_port()
    serve = [sys.executable, "-c", "from kvroute.cli import main; main()", "serve", "--port", str(port),
             "--worker", fleet.urls[0], "--model-alias", "claude-*=qwen3-4b",
             "--model-alias", "gpt-4o=qwen3-4b", "--log-level", "warning"]
    proc = await asyncio.create_subprocess_exec(*serve, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(http, url, proc)
        body = {"model": "claude-opus-4-1", "max_tokens": 5,
                "messages": [{"role": "user", "content": PROMPT}]}
        async with http.post(url + "/v1/messages", json=body) as resp:
            assert resp.status == 200 and (await resp.json())["model"] == "claude-opus-4-1"
        async with http.get(url + "/v1/models") as resp:
            assert (await resp.json())["aliases"] == {"claude-*": MODEL, "gpt-4o": MODEL}
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    bad = subprocess.run([*serve[:-2], "--model-alias", "claude-*"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert bad.returncode == 2 and "PATTERN=MODEL" in bad.stderr
