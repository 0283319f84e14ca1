"""The official OpenAI and Anthropic Python SDKs, pointed at the router, against simulated replicas."""

from __future__ import annotations

import aiohttp
import anthropic
import openai
import pytest

MODEL = "qwen3-4b"
PROMPT = "Tell me about prefix caching. " * 40


async def drop_streams_after(urls: list[str], tokens: int) -> None:
    """Make every replica cut its next streams after ``tokens`` tokens (the simulator's fault API)."""
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.post(url + "/admin/fault", json={"kind": "drop", "after_tokens": tokens}) as resp:
                assert resp.status == 200


@pytest.fixture
async def routed(sim_fleet, router):
    fleet = await sim_fleet(2)
    r = await router(fleet.urls)
    return fleet, r


async def test_openai_sdk_non_streaming_and_streaming(routed):
    _, r = routed
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        messages = [{"role": "user", "content": PROMPT}]
        done = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
        assert done.choices[0].message.content
        assert done.usage.prompt_tokens > 200
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                      stream=True, stream_options={"include_usage": True})
        pieces = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        assert text == done.choices[0].message.content  # the simulator's output is deterministic
        assert pieces[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same worker's cache
        legacy = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
        assert legacy.choices[0].text
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_openai_sdk_sees_errors_as_its_own_exceptions(routed):
    fleet, r = routed
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[])
        await drop_streams_after(fleet.urls, 3)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=30, stream=True)
        with pytest.raises(openai.APIError, match="mid-stream"):
            async for _ in stream:
                pass


async def test_anthropic_sdk_non_streaming_and_streaming(routed):
    _, r = routed
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with client:
        messages = [{"role": "user", "content": PROMPT}]
        done = await client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", messages=messages)
        assert done.content[0].text and done.stop_reason in ("end_turn", "max_tokens")
        async with client.messages.stream(model=MODEL, max_tokens=12, system="Be brief.",
                                          messages=messages) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == done.content[0].text
        assert final.usage.output_tokens == done.usage.output_tokens


async def test_anthropic_sdk_sees_errors_as_its_own_exceptions(routed):
    fleet, r = routed
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with client:
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="missing", max_tokens=5,
                                         messages=[{"role": "user", "content": "x"}])
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.create(model=MODEL, max_tokens=5, messages="not a list")  # type: ignore[arg-type]
        await drop_streams_after(fleet.urls, 3)
        with pytest.raises(anthropic.APIStatusError, match="mid-stream"):
            async with client.messages.stream(model=MODEL, max_tokens=30,
                                              messages=[{"role": "user", "content": PROMPT}]) as stream:
                async for _ in stream.text_stream:
                    pass
