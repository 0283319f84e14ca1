"""Agent-like traffic for the dashboard tests and screenshot: sessions whose chat grows each turn.

Each session shares a long system prompt with the others and sends its own growing history with an
``x-session-id`` header, so the router has sticky sessions to keep and the engines have prefixes
to reuse.  Bounded in sessions, turns and time.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

_WORDS = ("route ", "cache ", "block ", "token ", "prefix ", "replica ", "session ", "queue ")


def text(n_words: int, seed: int) -> str:
    """``n_words`` words of filler text, different for each seed."""
    rng = random.Random(seed)
    return "".join(rng.choice(_WORDS) for _ in range(n_words))


async def run_session(client: aiohttp.ClientSession, url: str, model: str, session: int, *, turns: int,
                      system_words: int = 1500, turn_words: int = 150, max_tokens: int = 24,
                      deadline: float = float("inf"), pause_s: float = 0.0) -> int:
    """One conversation of up to ``turns`` requests; returns how many succeeded (status 200)."""
    messages = [{"role": "system", "content": text(system_words, 0)}]
    ok = 0
    for turn in range(turns):
        if time.monotonic() > deadline:
            break
        messages.append({"role": "user", "content": text(turn_words, session * 1000 + turn)})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": turn % 2 == 0}
        async with client.post(f"{url}/v1/chat/completions", json=body,
                               headers={"x-session-id": f"agent-{session}"}) as resp:
            payload = await resp.read()
            if resp.status == 200:
                ok += 1
        messages.append({"role": "assistant", "content": f"answer {turn}: {len(payload)} bytes"})
        if pause_s:
            await asyncio.sleep(pause_s)
    return ok


async def run_sessions(url: str, model: str, sessions: int, turns: int, *, time_limit_s: float = 30.0,
                       first_session: int = 0, **kwargs: object) -> int:
    """``sessions`` conversations at once; returns the number of successful requests."""
    deadline = time.monotonic() + time_limit_s
    timeout = aiohttp.ClientTimeout(total=time_limit_s + 30)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        done = await asyncio.gather(*(
            run_session(client, url, model, first_session + s, turns=turns, deadline=deadline, **kwargs)
            for s in range(sessions)))
    return sum(done)
