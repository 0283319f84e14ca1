"""Helpers for the simulator tests: exact-size prompts and a virtual-time driver of one engine."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvroute.sim.answers import filler
from kvroute.sim.engine import EngineConfig, EngineEvent, EngineModel, EventKind, SimRequest
from kvroute.sim.tokenizer import render_chat

_WORDS = ("cat ", "dog ", "sun ", "red ", "sky ", "car ", "map ", "pen ")


def prose(n_tokens: int, seed: int) -> str:
    """``n_tokens`` pseudo-tokens of text (4 ASCII bytes each), different for each seed."""
    rng = random.Random(seed)
    return "".join(rng.choice(_WORDS) for _ in range(n_tokens))


@dataclass
class Outcome:
    """One request run to completion in virtual time."""

    latency: float          # request overhead + queueing + compute, model seconds
    ttft: float             # request overhead + time to first token
    finished: EngineEvent
    output: bytes

    @property
    def cached(self) -> int:
        return self.finished.cached_tokens


@dataclass
class VirtualEngine:
    """Runs requests one at a time (or a batch together) on one engine in virtual time."""

    config: EngineConfig
    now: float = 0.0
    engine: EngineModel = field(init=False)
    _n: int = 0

    def __post_init__(self) -> None:
        self.engine = EngineModel(self.config, self.now)

    def submit(self, prompt: bytes, out_tokens: int = 1, output: bytes | None = None) -> str:
        self._n += 1
        rid = f"r{self._n}"
        text = filler(prompt, out_tokens) if output is None else output
        self.engine.add_request(SimRequest(rid, prompt, text, out_tokens), self.now)
        return rid

    def drain(self, on_step=None) -> dict[str, list[tuple[float, EngineEvent]]]:
        """Step until idle; returns each request's events with their delivery times."""
        seen: dict[str, list[tuple[float, EngineEvent]]] = {}
        while self.engine.has_work():
            result = self.engine.step(self.now)
            assert result.duration_s > 0 or result.events, "a step with work must make progress"
            self.now += result.duration_s
            if on_step is not None:
                on_step(self.engine)
            for event in result.events:
                seen.setdefault(event.request_id, []).append((self.now, event))
        return seen

    def run(self, prompt: bytes, out_tokens: int = 1, output: bytes | None = None) -> Outcome:
        """One request alone, with the preset's per-request overhead in front of it."""
        start = self.now
        self.now += self.config.cost.request_overhead_s
        rid = self.submit(prompt, out_tokens, output)
        events = self.drain()[rid]
        first = next(t for t, e in events if e.kind is EventKind.TOKEN)
        done = next(e for _, e in events if e.kind is EventKind.FINISHED)
        text = filler(prompt, out_tokens) if output is None else output
        return Outcome(self.now - start, first - start, done, text)


def chat(*contents: str) -> list[dict[str, str]]:
    """Alternating user/assistant messages."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]


def render(messages: list[dict[str, str]]) -> bytes:
    return render_chat({"messages": messages})
