"""A growing conversation through kvroute stays on one real replica, and the engine itself says it
reused the previous turn: ``usage.prompt_tokens_details.cached_tokens`` and its prefix-cache counters."""

from __future__ import annotations

import uuid
from itertools import pairwise

import aiohttp
import pytest
from vllm_helpers import block_size, engine_metrics, replica_serving

from kvroute.server.app import RunningRouter
from kvroute_dev.growing_chat import GrowingChat, send_chat
from kvroute_dev.vllm_replicas import ReplicaFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]
TURNS = 4


async def test_growing_chat_stays_on_one_replica_and_hits_its_cache(
    vllm_fleet: ReplicaFleet, router: RunningRouter, served_model: str
) -> None:
    block = block_size(vllm_fleet.urls[0])
    hits_before = {url: engine_metrics(url).prefix_hits or 0.0 for url in vllm_fleet.urls}
    chat = GrowingChat(f"chat-{uuid.uuid4().hex[:12]}")
    answers = []
    async with aiohttp.ClientSession() as session:
        for _ in range(TURNS):
            answer = await send_chat(session, router.url, served_model, chat.ask())
            chat.answer(answer.reply)
            answers.append(answer)

        workers = {a.worker for a in answers}
        assert len(workers) == 1, f"the conversation moved between replicas: {[a.worker for a in answers]}"
        sticky = replica_serving(vllm_fleet, answers[0].worker)
        other = next(r for r in vllm_fleet.replicas if r is not sticky)

        assert answers[0].prompt_tokens >= 3 * block and answers[-1].prompt_tokens <= 2048
        assert answers[0].cached_tokens == 0, "a new conversation cannot have been cached"
        for previous, current in pairwise(answers):
            # Whole blocks of the previous prompt are reused; the new turn itself is computed.
            assert current.cached_tokens >= previous.prompt_tokens // block * block
            assert current.cached_tokens < current.prompt_tokens

        # The engines' counters agree: every cached token was a hit on the sticky replica alone.
        hits = {url: engine_metrics(url).prefix_hits or 0.0 for url in vllm_fleet.urls}
        assert hits[sticky.url] - hits_before[sticky.url] >= sum(a.cached_tokens for a in answers)
        assert hits[other.url] == hits_before[other.url]

        # The same last follow-up sent straight to the other replica: it never saw this conversation.
        last_prompt = chat.messages[:-1]
        direct = await send_chat(session, other.url, served_model, last_prompt)
        assert direct.prompt_tokens == answers[-1].prompt_tokens
        assert direct.cached_tokens == 0
