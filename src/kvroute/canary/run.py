"""Sending the canary's requests: one shared long prefix, a different question at the end of each."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import aiohttp

from kvroute.canary.questions import Question, grade, make_questions
from kvroute.canary.summary import CanaryReply, CanarySummary, excerpt, summarize
from kvroute.engine_client.cache_counters import CounterChange, read_counters
from kvroute.engine_client.chat import send_chat
from kvroute.engine_client.filler_text import filler
from kvroute.engine_client.http import Target, served_model

_SYSTEM = "Answer the question at the very end with the number only."


class CanaryError(RuntimeError):
    """The run could not start (no model to ask, target unreachable)."""


@dataclass(frozen=True, slots=True)
class CanaryOptions:
    """What ``kvroute canary`` was asked to do."""

    target: str
    requests: int = 150
    prefix_tokens: int = 13_000
    concurrency: int = 8
    max_tokens: int = 16
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 300.0
    seed: int = 0


async def run_canary(options: CanaryOptions) -> CanarySummary:
    """Send every question after the shared prefix and judge each reply.

    The first request goes alone so the prefix is cached before the rest arrive ``concurrency`` at
    a time: that is the path the canary exists to test.  The prefix starts with a fresh nonce so
    no earlier run's cache serves it.
    """
    target = Target(options.target, options.api_key, options.timeout_s)
    questions = make_questions(options.requests, options.seed)
    prefix = shared_prefix(options.prefix_tokens, secrets.token_hex(6))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=options.concurrency)) as session:
        model = options.model or await served_model(session, target)
        if model is None:
            raise CanaryError(f"could not read a model from {target.url('/v1/models')} "
                              "(is the target up? pass --model to name one)")
        before = await read_counters(session, target)
        gate = asyncio.Semaphore(options.concurrency)

        async def ask(index: int, question: Question) -> CanaryReply:
            async with gate:
                return await _ask(session, target, model, prefix, index, question, options.max_tokens)

        first = await ask(0, questions[0])
        rest = await asyncio.gather(*(ask(i, q) for i, q in enumerate(questions) if i > 0))
        after = await read_counters(session, target)
    change = CounterChange(before, after) if before is not None and after is not None else None
    return summarize([first, *rest], change)


def shared_prefix(tokens: int, nonce: str) -> str:
    """About ``tokens`` tokens of filler that start with ``nonce``, so that no other run's (or
    user's) cached prefix serves it."""
    return f"Canary {nonce}. " + filler(tokens, nonce)


def canary_messages(prefix: str, question: Question) -> list[dict[str, str]]:
    """The chat messages of one canary request: the instruction, then the long shared prefix with
    the question at its very end (the same shape ``kvroute canary`` and the fleet guard send)."""
    return [{"role": "system", "content": _SYSTEM},
            {"role": "user", "content": f"{prefix}\n\n{question.text}"}]


async def _ask(session: aiohttp.ClientSession, target: Target, model: str, prefix: str, index: int,
               question: Question, max_tokens: int) -> CanaryReply:
    outcome = await send_chat(session, target, model, canary_messages(prefix, question), max_tokens)
    verdict = grade(outcome.content, outcome.finish_reason, question.answer, outcome.error,
                    not_an_answer=outcome.not_an_answer)
    shown = outcome.error if outcome.error is not None else (outcome.content or "")
    return CanaryReply(index, question.text, question.answer, verdict, outcome.seconds, excerpt(shown),
                       outcome.prompt_tokens, outcome.cached_tokens)
