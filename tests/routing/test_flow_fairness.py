"""Flow control's order between priority classes and tenants (routing/flow.py): strict classes,
class-aware shedding, token-weighted fair shares between tenants, no credit for idle tenants, and
aging at a multiple of the median wait.  Pure: a simulated clock and a saturated fleet."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import pytest
from routing_helpers import Clock

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.dispatch import Dispatcher, InFlight
from kvroute.routing.fair_share import tenant_weights
from kvroute.routing.flow import FlowSettings, ShedReason, Ticket, TicketState
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

MODEL = "m"


class Fleet:
    """A dispatcher with flow control on in front of ``n`` replicas of ``seqs`` slots each, driven
    by hand: requests arrive, the oldest running one finishes, granted ones are sent."""

    def __init__(self, n: int = 1, seqs: int = 1, **policy: Any) -> None:
        self.clock = Clock(1000.0)
        cfg = RoutingConfig(default=ModelSettings(policy="least-loaded", flow_control=True, **policy))
        self.d = Dispatcher(Scheduler(cfg, clock=self.clock), timer=self.clock)
        self.workers = [WorkerState(f"w{i}", f"http://w{i}", frozenset({MODEL}), max_num_seqs=seqs)
                        for i in range(n)]
        self.running: list[InFlight] = []
        self.woken: list[Ticket] = []
        self.served: list[Ticket] = []
        # What the engine reports for a finished request: (prompt, output) tokens, or None (no usage).
        self.usage: Callable[[InFlight], tuple[int, int] | None] = lambda _: None
        self._n = 0

    def arrive(self, tokens: int = 100, tenant: str | None = None, priority: int = 0,
               max_tokens: int = 100) -> Ticket:
        self._n += 1
        k = RoutingKey(MODEL, f"r{self._n}-{tenant}".encode() * 8, None, tokens, max_tokens,
                       priority=priority, tenant=tenant)
        t = self.d.admit(k, self.workers, self.woken.append)
        if t.state is TicketState.GRANTED:
            self._send(t)
        return t

    def finish_oldest(self) -> None:
        flight = self.running.pop(0)
        prompt, output = self.usage(flight) or (None, None)
        self.d.finished(flight, ok=True, prompt_tokens=prompt, output_tokens=output)
        self.send_woken()

    def send_woken(self) -> None:
        while self.woken:
            t = self.woken.pop(0)
            if t.state is TicketState.GRANTED:
                self.d.claim(t)
                self._send(t)

    def _send(self, t: Ticket) -> None:
        decision = self.d.route(t.key, self.workers)
        assert decision.worker_id is not None
        state = next(w for w in self.workers if w.id == decision.worker_id)
        self.running.append(self.d.sent(t.key, decision, state)[0])
        self.served.append(t)

    def queued(self, tenant: str) -> int:
        return sum(1 for t in self.d.flow.queued(MODEL) if t.tenant == tenant)


# --- classes ------------------------------------------------------------------------------------

def test_classes_are_strict_high_before_normal_before_low() -> None:
    f = Fleet()
    f.arrive()  # takes the only slot
    low, normal, high = f.arrive(priority=-1), f.arrive(priority=0), f.arrive(priority=1)
    normal2 = f.arrive(priority=0)
    assert all(t.queued for t in (low, normal, high, normal2))
    for _ in range(4):
        f.finish_oldest()
    assert f.served[1:] == [high, normal, normal2, low]


def test_a_full_queue_sheds_the_lowest_class_newest_first() -> None:
    f = Fleet(flow_max_queued=3)
    f.arrive()
    told: list[Ticket] = []
    low_old, low_new, normal = f.arrive(priority=-1), f.arrive(priority=-1), f.arrive()
    low_old.on_decided = low_new.on_decided = normal.on_decided = told.append
    high = f.arrive(priority=1)  # displaces the newest of the lowest class
    assert high.queued and low_new.state is TicketState.SHED and told == [low_new]
    assert low_new.reason is ShedReason.DISPLACED and low_new.retry_after_s >= 1
    high2 = f.arrive(priority=1)
    assert high2.queued and low_old.state is TicketState.SHED
    normal2 = f.arrive()  # a normal request displaces only a lower class: none is left
    assert normal2.state is TicketState.SHED and normal2.reason is ShedReason.QUEUE_FULL
    assert normal.queued and f.d.flow.depth()[MODEL] == (3, 300)
    shed = f.d.flow.shed
    assert shed[(MODEL, "displaced", "low")] == 2 and shed[(MODEL, "queue_full", "normal")] == 1


def test_the_token_cap_displaces_as_many_as_it_takes_or_none() -> None:
    f = Fleet(flow_max_queued_tokens=1000)
    f.arrive()
    lows = [f.arrive(tokens=300, priority=-1) for _ in range(3)]
    high = f.arrive(tokens=700, priority=1)  # 900 + 700 > 1000: the two newest lows go
    assert high.queued and [t.state for t in lows] == [TicketState.QUEUED, TicketState.SHED,
                                                       TicketState.SHED]
    too_big = f.arrive(tokens=1200, priority=1)  # no lower class can make room for it
    assert too_big.state is TicketState.SHED and too_big.reason is ShedReason.QUEUE_TOKENS
    assert lows[0].queued


# --- tenants ------------------------------------------------------------------------------------

def run_backlogged(f: Fleet, offers: dict[str, tuple[int, int]], ticks: int) -> dict[str, int]:
    """Each tick every tenant offers its requests per tick (``offers``: tenant -> (requests, prompt
    tokens each)) while it has fewer than 40 queued — so both stay backlogged — and the oldest
    running request finishes.  Returns the tokens (prompt + max_tokens) served per tenant."""
    for _ in range(ticks):
        f.clock.now += 1.0
        for tenant, (n, tokens) in offers.items():
            for _ in range(n):
                if f.queued(tenant) < 40:
                    f.arrive(tokens=tokens, tenant=tenant)
        assert all(f.queued(tenant) > 0 for tenant in offers)  # saturated: both always wait
        f.finish_oldest()
    served: dict[str, int] = dict.fromkeys(offers, 0)
    for t in f.served:
        served[t.tenant] += t.key.est_prompt_tokens + t.key.max_tokens
    return served


@pytest.mark.parametrize("offers", [
    {"a": (10, 100), "b": (1, 100)},    # offered 10:1 in requests and tokens
    {"a": (10, 100), "b": (1, 1900)},   # b's requests are 10x bigger: equal tokens, 10:1 requests
])
def test_two_tenants_offered_10_to_1_get_even_token_shares(offers: dict[str, tuple[int, int]]) -> None:
    f = Fleet(n=4, seqs=2)
    served = run_backlogged(f, offers, ticks=400)
    share = served["a"] / (served["a"] + served["b"])
    assert 0.45 <= share <= 0.55, served


def test_the_charge_is_settled_to_the_tokens_the_engine_reports() -> None:
    """Tenant a's clients ask for max_tokens 4000 and get 100-token answers, b's ask for 100 and
    get 100: each request costs both the same, so once the engine's usage settles the estimate
    they are served as many requests each.  With no usage reported (an OpenAI stream without
    include_usage) the estimate stands, and a gets about one request in twenty."""
    def run(report: bool) -> tuple[float, dict[str, int]]:
        f = Fleet(n=4, seqs=2)
        if report:
            f.usage = lambda flight: (100, 100)
        for _ in range(400):
            f.clock.now += 1.0
            for tenant, max_tokens in (("a", 4000), ("b", 100)):
                while f.queued(tenant) < 20:
                    f.arrive(tokens=100, tenant=tenant, max_tokens=max_tokens)
            f.finish_oldest()
            f.send_woken()
        counts = {tenant: sum(1 for t in f.served[8:] if t.tenant == tenant) for tenant in "ab"}
        return counts["a"] / (counts["a"] + counts["b"]), dict(f.d.flow.tenant_tokens)

    settled, tokens = run(report=True)
    assert 0.45 <= settled <= 0.55
    # What /metrics counts is what was served: 200 tokens a request, for each tenant alike.
    assert tokens[(MODEL, "a")] % 200 == 0 and tokens[(MODEL, "b")] % 200 == 0
    estimated, tokens = run(report=False)
    assert estimated < 0.1
    assert tokens[(MODEL, "a")] % 4100 == 0  # no usage: the estimate is what is counted


def test_tenant_weights_set_the_shares() -> None:
    f = Fleet(n=2, seqs=2, flow_tenant_weights="a=3")
    served = run_backlogged(f, {"a": (5, 100), "b": (5, 100)}, ticks=400)
    assert 0.70 <= served["a"] / (served["a"] + served["b"]) <= 0.80, served


def test_one_tenant_alone_keeps_the_order_it_had() -> None:
    """Without tenant headers every request is the default tenant's: the cache order decides."""
    f = Fleet()
    f.arrive()
    big, small = f.arrive(tokens=5000), f.arrive(tokens=10)
    f.finish_oldest()
    f.finish_oldest()
    assert f.served[1:] == [small, big]


def test_an_idle_tenant_banks_no_credit() -> None:
    """b sends nothing while a is served alone; when b comes back it gets its fair half from then
    on, not an exclusive run to catch up on the service it did not ask for."""
    f = Fleet()
    f.arrive(tenant="a")
    run_backlogged(f, {"a": (3, 100)}, ticks=100)
    before = len(f.served)
    run_backlogged(f, {"a": (3, 100), "b": (3, 100)}, ticks=20)
    after = [t.tenant for t in f.served[before:]]
    assert 8 <= after.count("b") <= 12, after


def test_idle_tenants_are_forgotten() -> None:
    f = Fleet(n=2, seqs=2)
    for i in range(3000):  # a different tenant each time, each served and gone
        f.clock.now += 1.0
        f.arrive(tenant=f"t{i}")
        if f.running:
            f.finish_oldest()
    band = f.d.flow._models[MODEL].fair.classes[0]
    assert len(band.finish) <= 200
    tokens = f.d.flow.tenant_tokens
    assert len(tokens) == 33 and tokens[(MODEL, "other")] == (3000 - 32) * 200  # labels bounded


def test_tenant_weights_are_validated() -> None:
    assert tenant_weights("a=2, b=0.5") == {"a": 2.0, "b": 0.5}
    assert tenant_weights("") == {}
    for bad in ("a", "a=0", "=2", "a=x", "a=-1"):
        with pytest.raises(ValueError):
            FlowSettings(flow_tenant_weights=bad)


# --- aging --------------------------------------------------------------------------------------

def test_no_request_waits_more_than_a_bounded_multiple_of_the_median() -> None:
    """One slot; a steady stream of short prompts keeps about four queued, so each waits about
    four ticks.  A long prompt, which the cache order puts behind every short one, is admitted once
    it has waited flow_aging_factor x the median wait: its wait is bounded by that, plus one
    request's service, whatever keeps arriving."""
    factor = 3.0
    f = Fleet(flow_aging_s=1.0, flow_aging_factor=factor)
    f.arrive(tokens=10)
    for _ in range(4):
        f.arrive(tokens=10)

    def tick() -> None:
        f.clock.now += 1.0
        f.arrive(tokens=10)
        f.finish_oldest()

    for _ in range(50):  # warm up: the median wait settles at about four ticks
        tick()
    long = f.arrive(tokens=20_000)
    for _ in range(200):  # bounded: the stream never stops on its own
        tick()
        if long in f.served:
            break
    assert long in f.served
    median = statistics.median(f.d.flow._models[MODEL].queue.waits)  # what the threshold is made of
    shorts = [t.waited_s for t in f.served if t.key.est_prompt_tokens == 10 and t.waited_s > 0]
    assert 3.0 <= median <= 5.0 and median == pytest.approx(statistics.median(shorts[-256:]), abs=1)
    assert long.waited_s <= factor * median + 1.0
    assert long.waited_s > 1.0  # not the floor: it did wait behind the stream


def test_without_aging_the_stream_starves_the_long_prompt() -> None:
    """The same stream with aging out of reach: the long prompt never goes (the bound above is the
    aging rule's doing)."""
    f = Fleet(flow_aging_s=10_000.0)
    f.arrive(tokens=10)
    for _ in range(4):
        f.arrive(tokens=10)
    long = f.arrive(tokens=20_000)
    for _ in range(200):
        f.clock.now += 1.0
        f.arrive(tokens=10)
        f.finish_oldest()
    assert long.queued


# --- what readers see -----------------------------------------------------------------------

def test_depth_by_class_and_tokens_served_per_tenant() -> None:
    f = Fleet()
    f.arrive(tenant="a", tokens=100)
    f.clock.now += 2.0
    f.arrive(tenant="b", priority=1, tokens=300)
    f.clock.now += 1.0
    f.arrive(tenant="b", priority=-1, tokens=50)
    depth = f.d.flow.depth_by_class()
    assert depth[(MODEL, "high")] == (1, 300) and depth[(MODEL, "normal")] == (0, 0)
    assert depth[(MODEL, "low")] == (1, 50) and f.queued("b") == 2
    assert f.d.flow.tenant_tokens == {}  # nothing answered yet
    f.usage = lambda flight: (120, 30)
    f.finish_oldest()  # a's request is answered; b's high one takes the slot
    assert f.d.flow.tenant_tokens == {(MODEL, "a"): 150}
    assert f.d.flow.depth_by_class()[(MODEL, "high")] == (0, 0)
