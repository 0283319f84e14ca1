"""What a probe's requests prove about the cache: evidence, not a guess.

The probe sends one prompt cold, the same prompt again, then grows it into a conversation turn by
turn.  For each request it records the time, the ``cached_tokens`` the engine reported in
``usage`` (per request, so other traffic cannot disturb it) and how far the engine's own hit and
query counters moved (global, so other traffic can).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp

from kvroute.doctor.checks import COARSE_UNIT, suggest_match_unit
from kvroute.doctor.finding import Finding, Severity
from kvroute.engine_client.cache_counters import PrefixCacheReading, read_counters
from kvroute.engine_client.chat import ChatOutcome, send_chat
from kvroute.engine_client.filler_text import filler
from kvroute.engine_client.http import Target

# --- judging what the probe's requests showed -----------------------------------------------------

# A repeat this much faster than the cold request counts as a visible hit when nothing else tells.
_VISIBLE_SPEEDUP = 1.5
# A follow-up turn "reuses the previous turn" when at least this share of that turn's prompt hit.
_COVERED = 0.9


@dataclass(frozen=True, slots=True)
class ProbeStep:
    """One probe request as measured.  ``cached_tokens`` is None when ``usage`` does not report
    it; the deltas are None when ``/metrics`` could not be read."""

    label: str
    seconds: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    hits_delta: float | None = None
    queries_delta: float | None = None
    error: str | None = None

    def reused(self) -> float | None:
        """Tokens served from the cache: ``usage`` first (per request), else the counters."""
        if self.cached_tokens is not None:
            return float(self.cached_tokens)
        return self.hits_delta

    def as_dict(self) -> dict[str, object]:
        """The JSON form used by ``--json``."""
        return asdict(self)


def judge_probe(steps: Sequence[ProbeStep], block_size: int | None = None,
                match_unit: int | None = None) -> list[Finding]:
    """Findings from a probe: steps are cold, repeat, then one or more conversation turns."""
    failed = [s for s in steps if s.error is not None]
    if failed:
        return [Finding(Severity.WARNING, "probe-failed", "The probe's requests failed",
                        "; ".join(f"{s.label}: {s.error}" for s in failed),
                        "check the model name and that the engine accepts chat completions",
                        tuple(_describe(s) for s in steps))]
    if len(steps) < 2:
        return []
    cold, repeat, turns = steps[0], steps[1], list(steps[2:])
    unit = match_unit or block_size
    turns_hit = any((t.reused() or 0) > 0 for t in turns)
    findings = [_judge_repeat(cold, repeat, turns_hit)]
    if repeat.cached_tokens is None and (repeat.hits_delta or any(t.hits_delta for t in turns)):
        findings.append(Finding(
            Severity.INFO, "probe-no-cached-tokens", "usage does not report cached tokens",
            "The counters show hits, but responses carry no usage.prompt_tokens_details.cached_tokens, "
            "so clients cannot see them per request.", "--enable-prompt-tokens-details", ()))
    if turns and ((repeat.reused() or 0) > 0 or turns_hit):
        findings.append(_judge_turns([repeat, *turns], block_size, unit))
    return findings


def _judge_repeat(cold: ProbeStep, repeat: ProbeStep, turns_hit: bool) -> Finding:
    evidence = (_describe(cold), _describe(repeat))
    reused = repeat.reused()
    size = f"{repeat.prompt_tokens:,}-token" if repeat.prompt_tokens else "repeated"
    timing = f"{cold.seconds:.2f} s cold, {repeat.seconds:.2f} s repeated"
    if reused is None:
        if repeat.seconds * _VISIBLE_SPEEDUP <= cold.seconds:
            return Finding(Severity.INFO, "probe-faster",
                           f"The repeated prompt was {cold.seconds / repeat.seconds:.1f}× faster",
                           f"{timing}. The engine reports neither cached tokens nor hit counters, "
                           "so speed is the only evidence.", None, evidence)
        return Finding(Severity.WARNING, "probe-no-evidence", "No evidence of a cache hit",
                       f"{timing}, and the engine reports neither cached tokens nor hit counters.",
                       "--enable-prompt-tokens-details, and expose /metrics", evidence)
    if reused > 0:
        return Finding(Severity.OK, "probe-repeat-hit",
                       f"A {size} prompt sent twice reused {reused:,.0f} tokens the second time",
                       f"{timing}.", None, evidence)
    if turns_hit:
        return Finding(
            Severity.INFO, "probe-repeat-miss",
            f"A {size} prompt sent twice reused nothing, but the conversation's next turns did",
            f"{timing}. On a hybrid model a hit can only resume where a state checkpoint exists: "
            "the end of a scheduler step on a match-unit boundary. An exact repeat may end between "
            "checkpoints; a conversation's next turn starts after the previous reply, where one was "
            "written.", None, evidence)
    return Finding(Severity.ERROR, "probe-no-hit",
                   f"Neither a {size} prompt sent twice nor a growing conversation reused anything",
                   f"{timing}: a repeated prompt costs what a new one does, so the cache is not "
                   "working at all. The configuration findings say why.",
                   "apply the fixes above and probe again", evidence)


def _judge_turns(steps: Sequence[ProbeStep], block_size: int | None, unit: int | None) -> Finding:
    """Each turn should reuse (nearly) all of the previous request's prompt."""
    evidence = tuple(_describe(t) for t in steps[1:])
    shares: list[str] = []
    covered = True
    for previous, turn in itertools.pairwise(steps):
        reused = turn.reused() or 0.0
        had = previous.prompt_tokens
        if had:
            shares.append(f"{turn.label} {reused:,.0f} of {had:,}")
            covered = covered and reused >= _COVERED * had
        else:
            shares.append(f"{turn.label} {reused:,.0f}")
            covered = covered and reused > 0
    detail = "Reused per turn, of the previous request's prompt tokens: " + ", ".join(shares) + "."
    if covered:
        return Finding(Severity.OK, "probe-conversation-hit",
                       "Each follow-up turn of a growing conversation reused the previous turn",
                       detail, None, evidence)
    coarse = unit is not None and unit >= COARSE_UNIT
    why = (f" Hits can only land on multiples of {unit:,} tokens, so the tail of every turn is "
           "recomputed." if coarse else "")
    fix = f"--prefix-match-unit {suggest_match_unit(block_size or unit or 32)}" if coarse else None
    return Finding(Severity.WARNING, "probe-conversation-partial",
                   "A growing conversation's next turn does not reuse the whole previous turn",
                   detail + why, fix, evidence)


def _describe(step: ProbeStep) -> str:
    parts = [f"{step.label}: {step.seconds:.3f} s"]
    if step.prompt_tokens is not None:
        parts.append(f"prompt {step.prompt_tokens:,}")
    if step.cached_tokens is not None:
        parts.append(f"cached_tokens {step.cached_tokens:,}")
    if step.hits_delta is not None and step.queries_delta is not None:
        parts.append(f"counters +{step.hits_delta:,.0f} hits / +{step.queries_delta:,.0f} queries")
    if step.error is not None:
        parts.append(f"error {step.error}")
    return ", ".join(parts)


# --- sending the probe's requests (the I/O half) --------------------------------------------------

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


def _step(label: str, outcome: ChatOutcome, before: PrefixCacheReading | None,
          after: PrefixCacheReading | None) -> ProbeStep:
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
