"""Benchmark workloads: agent sessions and a growing chat, fully determined by a seed.

Sizes are given in tokens of the simulator's pseudo-tokenizer, where a token is four bytes of the
rendered prompt; the generated text is ASCII made of four-byte words, so a message of ``n`` tokens is
``4*n`` bytes and the token counts the replicas report match the plan to within the chat template's
few bytes per message.  A real tokenizer counts these words differently, which changes the absolute
sizes but not the shape: the shared and unique parts of every prompt stay where the plan puts them.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

SESSION_HEADER = "X-Claude-Code-Session-Id"
# Times an agent sends a request the router sheds before it gives up on its task (the openai SDK
# retries a 429 after its Retry-After; a client bounds its tries), in both clocks.
SHED_TRIES = 10

# Every word is three letters and a space: exactly one pseudo-token.
_VOCAB: tuple[str, ...] = tuple(a + b + c + " " for a in "bcdfghjklmnprstvz" for b in "aeiou"
                                for c in "bcdfghjklmnprstvz")

@dataclass(frozen=True, slots=True)
class Message:
    """One chat message as sent to the engine."""

    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        """The OpenAI/Anthropic wire form of this message."""
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a session: the whole conversation so far, the output budget, and how long the
    client pauses after the previous response before sending it (``think_s``: an agent running its
    tools)."""

    session_id: str | None
    round: int
    system: str
    messages: tuple[Message, ...]
    max_tokens: int
    think_s: float = 0.0

    @property
    def est_prompt_tokens(self) -> int:
        """Planned prompt size in pseudo-tokens (four bytes each), without the template's framing."""
        return (len(self.system) + sum(len(m.content) for m in self.messages)) // 4

    def openai_body(self, model: str, *, stream: bool = True) -> dict[str, Any]:
        """An OpenAI ``/v1/chat/completions`` body (system prompt as the first message)."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.extend(m.as_dict() for m in self.messages)
        # ignore_eos (a vLLM extension) makes the reply exactly max_tokens long, the length of the
        # answer the workload planned for the next round's history.
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": self.max_tokens,
                                "stream": stream, "temperature": 0, "ignore_eos": True}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def anthropic_body(self, model: str, *, stream: bool = True) -> dict[str, Any]:
        """An Anthropic ``/v1/messages`` body."""
        body: dict[str, Any] = {"model": model, "messages": [m.as_dict() for m in self.messages],
                                "max_tokens": self.max_tokens, "stream": stream}
        if self.system:
            body["system"] = self.system
        return body

    def headers(self) -> dict[str, str]:
        """Headers a Claude Code client would send with this request (the session id, if any)."""
        return {SESSION_HEADER: self.session_id} if self.session_id else {}


@dataclass(frozen=True, slots=True)
class SessionScript:
    """Every request of one session, in order; request ``i`` extends request ``i-1``."""

    session_id: str | None
    requests: tuple[PlannedRequest, ...]

    @property
    def rounds(self) -> int:
        """Number of requests in the session."""
        return len(self.requests)


class Workload(Protocol):
    """A source of sessions addressed by index, so that every policy replays the same ones."""

    @property
    def size(self) -> int | None:
        """How many sessions there are; None for an endless synthetic workload."""
        ...

    def session(self, index: int) -> SessionScript:
        """Session number ``index``; IndexError past the end of a finite workload."""
        ...


@dataclass(frozen=True, slots=True)
class AgentWorkloadConfig:
    """Synthetic Claude-Code-style agent sessions, as the session-stickiness benchmark sent them.

    A system prompt shared by every session (``system_prompts`` distinct ones, sessions drawn among
    them, model the share of the prefix), a first message unique to the session, then ``rounds``
    follow-ups that each append the previous answer and ``round_tokens`` new tokens.  Every input
    size varies by up to ``jitter`` (a fraction) around its nominal value; each answer is between
    ``min_output_tokens`` and ``max_output_tokens`` long (by default always that benchmark's maximum, 256).
    Between rounds the agent pauses for its tools: uniformly between 0 and twice ``think_time_s``
    (drawn from a separate stream, so the pause never changes the prompts).
    """

    system_tokens: int = 3500
    first_tokens: int = 7000
    rounds: int = 5
    round_tokens: int = 400
    max_output_tokens: int = 256
    min_output_tokens: int = 256
    system_prompts: int = 1
    jitter: float = 0.1
    # The session-stickiness benchmark measured 2.71-2.83 of 4 replicas busy at 4 sessions: each
    # session's replica idled ~30 % of a ~10 s round, i.e. ~3 s between a response's end and the next
    # request (see docs/benchmarks.md).  0 gives a strict closed loop.
    think_time_s: float = 3.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.think_time_s < float("inf"):
            raise ValueError("think_time_s must be a finite number >= 0")
        for name in ("system_tokens", "first_tokens", "round_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.rounds < 0:
            raise ValueError("rounds must be >= 0")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError("need 1 <= min_output_tokens <= max_output_tokens")
        if self.system_prompts < 1:
            raise ValueError("system_prompts must be >= 1")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")

    def describe(self, seed: int) -> str:
        """The workload in words, as the demo and the benchmark print it above their tables."""
        shared = ("a system prompt every session shares" if self.system_prompts == 1
                  else f"one of {self.system_prompts} system prompts")
        low, high = self.min_output_tokens, self.max_output_tokens
        answers = f"answers of {high:,} tokens" if low == high else f"answers of {low:,}-{high:,} tokens"
        pause = (f"{self.think_time_s:g} s on average between an answer and the next turn"
                 if self.think_time_s else "no pause between turns")
        return (f"Agent sessions (seed {seed}): {shared} ({self.system_tokens:,} tokens), a first message "
                f"of its own ({self.first_tokens:,} tokens), then {self.rounds} follow-ups of "
                f"{self.round_tokens:,} new tokens each; {answers}; {pause}; sizes vary by up to "
                f"{self.jitter:.0%}.")


def words(rng: random.Random, tokens: int) -> str:
    """``tokens`` pseudo-words of four bytes each (three letters and a space)."""
    return "".join(rng.choices(_VOCAB, k=tokens))


def _jittered(rng: random.Random, nominal: int, jitter: float) -> int:
    if nominal == 0 or jitter == 0.0:
        return nominal
    return max(1, round(nominal * (1.0 + rng.uniform(-jitter, jitter))))


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """An endless, deterministic sequence of agent sessions: session ``i`` depends only on the seed
    and ``i``, so every policy of an A/B sees byte-identical prompts in the same order."""

    config: AgentWorkloadConfig = field(default_factory=AgentWorkloadConfig)
    seed: int = 0
    _systems: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        systems = tuple(self._make_system(i) for i in range(self.config.system_prompts))
        object.__setattr__(self, "_systems", systems)

    @property
    def size(self) -> int | None:
        """Endless: any index is a session."""
        return None

    def system_prompt(self, index: int) -> str:
        """Shared system prompt number ``index`` (of ``config.system_prompts``)."""
        return self._systems[index]

    def _make_system(self, index: int) -> str:
        rng = random.Random(f"kvroute-agent-system:{self.seed}:{index}")
        head = f"You are coding agent profile {index}. Follow the repository conventions.\n"
        return head + words(rng, max(0, self.config.system_tokens - len(head) // 4))

    def session(self, index: int) -> SessionScript:
        """The ``index``-th session of this workload."""
        if index < 0:
            raise IndexError(index)
        cfg = self.config
        rng = random.Random(f"kvroute-agent-session:{self.seed}:{index}")
        pauses = random.Random(f"kvroute-agent-think:{self.seed}:{index}")
        session_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        system = self.system_prompt(rng.randrange(cfg.system_prompts))
        history: list[Message] = []
        requests: list[PlannedRequest] = []
        for rnd in range(cfg.rounds + 1):
            if rnd == 0:
                text = f"Task {session_id}:\n" + words(rng, _jittered(rng, cfg.first_tokens, cfg.jitter))
            else:
                # The answer the agent got last round goes back into its history.  It is planned
                # here rather than copied from the replica so that prompts never depend on which
                # policy ran; the engine recomputes at most those few hundred tokens.
                answer = words(rng, requests[-1].max_tokens)
                history.append(Message("assistant", answer))
                text = f"Tool result {rnd}:\n" + words(rng, _jittered(rng, cfg.round_tokens, cfg.jitter))
            history.append(Message("user", text))
            out = rng.randint(cfg.min_output_tokens, cfg.max_output_tokens)
            think = pauses.uniform(0.0, 2.0 * cfg.think_time_s) if rnd and cfg.think_time_s else 0.0
            requests.append(PlannedRequest(session_id, rnd, system, tuple(history), out, think))
        return SessionScript(session_id, tuple(requests))

    def sessions(self, start: int = 0) -> Iterator[SessionScript]:
        """Sessions ``start``, ``start+1``, ... forever."""
        index = start
        while True:
            yield self.session(index)
            index += 1


@dataclass(frozen=True, slots=True)
class GrowingChatConfig:
    """The prefix-hashing design's measurement: one conversation of ``first_tokens`` grown by
    ``turn_tokens`` per turn, one token of output each, with an unrelated conversation of
    ``other_tokens`` sent after turn ``other_after`` (0 to leave it out)."""

    first_tokens: int = 5600
    turn_tokens: int = 190
    turns: int = 5
    output_tokens: int = 1
    other_tokens: int = 5700
    other_after: int = 3

    def __post_init__(self) -> None:
        if self.first_tokens < 1 or self.turn_tokens < 1 or self.turns < 1 or self.output_tokens < 1:
            raise ValueError("growing chat sizes, turns and output tokens must be >= 1")
        if not 0 <= self.other_after <= self.turns:
            raise ValueError("other_after must be between 0 and turns")


@dataclass(frozen=True, slots=True)
class ChatStep:
    """One row of the growing-chat table: which turn, and the request to send."""

    label: str
    request: PlannedRequest


def growing_chat(config: GrowingChatConfig, seed: int = 0) -> list[ChatStep]:
    """The requests of the growing-chat table in the order they are sent.  Like the prefix-hashing
    design's API calls they carry no session id: only the prompt itself can keep a turn where its
    prefix is cached."""
    rng = random.Random(f"kvroute-chat:{seed}")
    history: list[Message] = []
    steps: list[ChatStep] = []
    for turn in range(1, config.turns + 1):
        if turn == 1:
            history.append(Message("user", words(rng, config.first_tokens)))
            label = "1 (cold)"
        else:
            history.append(Message("assistant", words(rng, config.output_tokens)))
            history.append(Message("user", words(rng, config.turn_tokens - config.output_tokens)))
            label = str(turn)
        steps.append(ChatStep(label, PlannedRequest(None, turn - 1, "", tuple(history),
                                                    config.output_tokens)))
        if turn == config.other_after:
            other = (Message("user", words(rng, config.other_tokens)),)
            steps.append(ChatStep("a different conversation",
                                  PlannedRequest(None, 0, "", other, config.output_tokens)))
    return steps


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    """llm-d's shared-prefix benchmark shape: ``groups`` groups of clients, each group with its own
    long system prompt of ``system_tokens`` and ``questions`` short questions of ``question_tokens``,
    each answered in ``output_tokens``; requests carry no session id and arrive open-loop (Poisson
    at the step's rate), each from a uniformly drawn group with one of that group's questions.

    The default fleet is 4 replicas of preset ``a4000-qwen3-4b``: ``build_config('a4000-qwen3-4b')``
    has ``num_gpu_blocks = 2543`` blocks of ``block_size = 16``, i.e. 40,688 KV tokens per replica,
    162,752 for the fleet.  The groups' system prompts together are about half of that:
    ``groups = round(0.5 * 162,752 / 6,000) = round(13.56) = 14`` groups of 6,000 tokens, 84,000
    tokens (52 % of the fleet's KV).  A policy that keeps each group on one replica holds 3-4
    prompts (~21,000 tokens) per replica and leaves the rest for the questions and the answers; one
    that spreads every group over every replica needs 84,000 tokens on each and cannot keep them.
    """

    groups: int = 14
    system_tokens: int = 6000
    questions: int = 32
    question_tokens: int = 150
    output_tokens: int = 200

    def __post_init__(self) -> None:
        for name in ("groups", "questions", "question_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.system_tokens < 0:
            raise ValueError("system_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """An open-loop request and when it arrives, in seconds since its step started."""

    at_s: float
    index: int
    request: PlannedRequest


@dataclass(frozen=True, slots=True)
class SharedPrefixWorkload:
    """Deterministic shared-prefix requests: request ``i`` depends only on the seed and ``i`` (its
    group and question), and a step's arrival times only on the seed, the step's first index and its
    rate, so every policy of an A/B sees the same requests at the same instants."""

    config: SharedPrefixConfig = field(default_factory=SharedPrefixConfig)
    seed: int = 0
    _systems: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _questions: tuple[tuple[str, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cfg = self.config
        systems, questions = [], []
        for g in range(cfg.groups):
            rng = random.Random(f"kvroute-shared-system:{self.seed}:{g}")
            head = f"You are assistant {g} of the shared-prefix benchmark.\n"
            systems.append(head + words(rng, max(0, cfg.system_tokens - len(head) // 4)))
            # The question's own head keeps every question distinct from its first token on.
            questions.append(tuple(f"Question {g}.{q}:\n" + words(rng, cfg.question_tokens)
                                   for q in range(cfg.questions)))
        object.__setattr__(self, "_systems", tuple(systems))
        object.__setattr__(self, "_questions", tuple(questions))

    def request(self, index: int) -> PlannedRequest:
        """Request number ``index``: its group's system prompt and one of that group's questions."""
        if index < 0:
            raise IndexError(index)
        rng = random.Random(f"kvroute-shared-request:{self.seed}:{index}")
        group = rng.randrange(self.config.groups)
        question = self._questions[group][rng.randrange(self.config.questions)]
        return PlannedRequest(None, 0, self._systems[group], (Message("user", question),),
                              self.config.output_tokens)

    def arrivals(self, rate: float, duration_s: float, first_index: int = 0) -> Iterator[TimedRequest]:
        """Poisson arrivals at ``rate`` requests/s for ``duration_s`` seconds, numbered from
        ``first_index``.  The gaps are one seeded stream of unit exponentials divided by the rate,
        so a faster step is the slower one compressed in time (the same requests, in the same order)."""
        if not 0.0 < rate < float("inf") or duration_s <= 0:
            raise ValueError("rate and duration must be positive and finite")
        gaps = random.Random(f"kvroute-shared-arrivals:{self.seed}:{first_index}")
        at, index = gaps.expovariate(1.0) / rate, first_index
        while at < duration_s:
            yield TimedRequest(at, index, self.request(index))
            at += gaps.expovariate(1.0) / rate
            index += 1
