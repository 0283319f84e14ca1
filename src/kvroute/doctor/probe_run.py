"""Sending the probe's requests (the I/O half of ``probe_evidence``)."""

from __future__ import annotations

import aiohttp

from kvroute.doctor.probe import ProbeStep
from kvroute.engine_client.cache_counters import CacheCounters
from kvroute.engine_client.chat import ChatOutcome, send_chat
from kvroute.engine_client.filler_text import filler
from kvroute.engine_client.http import Target, read_counters

# New text per conversation turn, like a user's next message.
_TURN_TOKENS = 150
_TURNS = 2
# Replies long enough to cross a fine match unit twice: a hybrid in align mode checkpoints its
# state at the end of a decode step on a unit boundary, which the next turn can resume from.
_MIN_REPLY, _MAX_REPLY = 16, 128


def probe_size(match_unit: int | None, max_model_len: int | None, requested: int | None) -> int:
    """Prompt tokens for the probe: several match units long, within the context window."""
    size = requested or max(3000, 3 * (match_unit or 0))
    if max_model_len is not None:
        # Room for the conversation turns and their replies.
        size = min(size, max_model_len - (_TURNS + 1) * (_TURN_TOKENS + _MAX_REPLY) - 64)
    return max(size, 64)


def reply_tokens(match_unit: int | None) -> int:
    """``max_tokens`` for every probe request: two match units, within bounds."""
    return min(max(2 * (match_unit or 0), _MIN_REPLY), _MAX_REPLY)


async def run_probe(session: aiohttp.ClientSession, target: Target, model: str, prompt_tokens: int,
                    nonce: str, max_tokens: int = _MIN_REPLY) -> list[ProbeStep]:
    """Cold prompt, the same again, then a conversation growing from it; counters after each.

    ``nonce`` starts the prompt so the first request is cold even if the probe ran before.
    """
    messages = [{"role": "user", "content": f"Probe {nonce}. " + filler(prompt_tokens, nonce)}]
    counters = await read_counters(session, target)
    steps: list[ProbeStep] = []
    reply = ""
    labels = ["cold", "repeat", *(f"turn {n}" for n in range(2, _TURNS + 2))]
    for index, label in enumerate(labels):
        if index >= 2:
            messages += [
                {"role": "assistant", "content": reply or "ok"},
                {"role": "user", "content": filler(_TURN_TOKENS, f"{nonce}-{label}")},
            ]
        last = await send_chat(session, target, model, messages, max_tokens)
        reply = last.content or ""
        after = await read_counters(session, target)
        steps.append(_step(label, last, counters, after))
        counters = after
        if last.error is not None:
            break
    return steps


def _step(label: str, outcome: ChatOutcome, before: CacheCounters | None,
          after: CacheCounters | None) -> ProbeStep:
    moved = before is not None and after is not None
    return ProbeStep(
        label=label,
        seconds=outcome.seconds,
        prompt_tokens=outcome.prompt_tokens,
        cached_tokens=outcome.cached_tokens,
        hits_delta=after.hits - before.hits if moved else None,  # type: ignore[union-attr]
        queries_delta=after.queries - before.queries if moved else None,  # type: ignore[union-attr]
        error=outcome.error,
    )
