"""The canary's I/O edge: a background task of the router that sends the rounds ``CanaryWatch``
schedules straight to each replica and applies its verdicts to the registry.

Canary questions go to the replica's own URL, not through the router's front door: each must reach
one named replica (a held one included, which routing would never pick), and nothing of the user
path may see them — no flow-control ticket, no routing decision, no ``Scheduler.commit`` (so no
prefix-index entry, session binding or backlog), no learning, no request counter, TTFB sample or
activity entry.  Their load is still the router's to know: ``Dispatcher.side_sent`` counts each in
its replica's in-flight figures until ``side_finished``, so routing sees it like any other request.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

import aiohttp

from kvroute.canary.questions import grade
from kvroute.canary.run import canary_messages, shared_prefix
from kvroute.canary.summary import excerpt
from kvroute.engine_client.chat import send_chat
from kvroute.engine_client.http import Target
from kvroute.event_loop import cancel_and_wait
from kvroute.fleet.registry import Registry
from kvroute.guard.canary_watch import CanaryAnswer, CanaryAsk, CanaryRound, CanarySettings, CanaryWatch
from kvroute.routing.learning import LearningSettings
from kvroute.routing.worker import WorkerState

log = logging.getLogger("kvroute.fleet.guard")

HOLD_REASON = "canary"
# How often the schedule is looked at, at most (a round's own interval is a setting).
_MAX_TICK_S = 0.25


class CanaryRunner:
    """Runs the canary for one router: ``start()`` once the fleet is registered, ``close()`` at
    shutdown.  ``share`` is this process's part of the budget (``1 / processes``); ``api_key`` the
    workers' key (``worker_api_key``)."""

    def __init__(self, registry: Registry, *, share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, api_key: str | None = None) -> None:
        self.registry = registry
        self._api_key = api_key
        scheduler = registry.dispatch.scheduler
        self.watch = CanaryWatch(lambda model: scheduler.settings_for(model).block(CanarySettings),
                                 nonce=secrets.token_hex(6), clock=clock, share=share)
        self._task: asyncio.Task[None] | None = None
        self._rounds: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """Start the schedule in the running event loop (a no-op while it runs)."""
        if self._task is None:
            self._session = aiohttp.ClientSession()
            self._task = asyncio.create_task(self._loop(), name="kvroute-canary")

    async def close(self) -> None:
        """Stop the schedule and abandon the rounds under way (their load is given back)."""
        await cancel_and_wait([self._task, *self._rounds])
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self) -> None:
        scheduler = self.registry.dispatch.scheduler
        while True:
            try:
                self.tick()
            except Exception:
                log.exception("canary: scheduling a round failed")
            interval = scheduler.settings_for("").block(CanarySettings).canary_interval_s
            await asyncio.sleep(min(_MAX_TICK_S, interval / 2))

    def tick(self) -> None:
        """Send the rounds that are due now."""
        for rnd in self.watch.due(self.registry.states(), self._capacity, shared_prefix):
            task = asyncio.create_task(self._round(rnd))
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)

    def _capacity(self, state: WorkerState) -> float:
        """Prefill tokens per second ``state`` serves, as the router has learnt it from the engine's
        reported times to first token (the configured speed until it has)."""
        scheduler = self.registry.dispatch.scheduler
        s_per_token = scheduler.prefill_s_per_token(state.id)
        if s_per_token <= 0:
            s_per_token = scheduler.config.default.block(LearningSettings).prefill_s_per_token
        return 1.0 / s_per_token

    async def _round(self, rnd: CanaryRound) -> None:
        answers: dict[str, CanaryAnswer] = {}
        # Every ask runs to its end (its own timeout) and the round is settled with the answers
        # that came back: an unsettled round would stop the model's canary.
        replies = await asyncio.gather(*(self._ask(rnd, ask) for ask in rnd.asks), return_exceptions=True)
        for ask, reply in zip(rnd.asks, replies, strict=True):
            if isinstance(reply, CanaryAnswer):
                answers[ask.worker_id] = reply
            elif isinstance(reply, BaseException):
                log.error("canary: round %d, %s: %r", rnd.number, ask.worker_id, reply)
        for change in self.watch.finish(rnd, answers):
            if self.registry.set_guard_hold(change.worker_id, HOLD_REASON, change.hold) is None:
                continue
            if change.hold:
                log.warning("canary: holding %s out of rotation: %s", change.worker_id, change.detail)
            else:
                log.warning("canary: %s back in rotation: %s", change.worker_id, change.detail)

    async def _ask(self, rnd: CanaryRound, ask: CanaryAsk) -> CanaryAnswer | None:
        record = self.registry.get(ask.worker_id)
        session = self._session
        if record is None or session is None or not record.state.models:
            return None
        state = record.state
        dispatch = self.registry.dispatch
        dispatch.side_sent(state)
        try:
            outcome = await send_chat(session, Target(ask.url, self._api_key, rnd.timeout_s), rnd.model,
                                      canary_messages(rnd.prefix, rnd.question), rnd.max_tokens)
        finally:
            dispatch.side_finished(state)
        verdict = grade(outcome.content, outcome.finish_reason, rnd.question.answer, outcome.error,
                    not_an_answer=outcome.not_an_answer)
        shown = outcome.error if outcome.error is not None else (outcome.content or "")
        return CanaryAnswer(verdict, outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens,
                            excerpt(shown))
