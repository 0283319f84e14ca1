"""``Decision.predicted_ttft_s``: computed once, by the scheduler, for every policy."""

from __future__ import annotations

import pytest
from routing_helpers import Clock, fleet, key, text

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.learning import LearningSettings
from kvroute.routing.scheduler import Scheduler


@pytest.mark.parametrize("policy", ["auto", "round-robin", "prefix", "session", "p2c", "least-loaded"])
def test_every_policy_predicts_the_prefill_of_a_cold_prompt(policy):
    s = Scheduler(RoutingConfig(default=ModelSettings(policy=policy)), clock=Clock())
    k = key(text(1, 40_000), session="s")
    d = s.decide(k, fleet(3))
    spt = LearningSettings().prefill_s_per_token
    # Nothing cached, nothing queued: the whole prompt's prefill at the configured speed.
    assert d.predicted_ttft_s == pytest.approx(spt * d.prefill_tokens, rel=1e-6)
    assert d.prefill_tokens == k.est_prompt_tokens


def test_a_worker_with_work_in_flight_is_predicted_slower():
    s = Scheduler(RoutingConfig(default=ModelSettings(policy="round-robin")), clock=Clock())
    workers = fleet(1)
    first = s.decide(key(text(1, 40_000)), workers)
    s.commit(key(text(1, 40_000)), first)  # its prefill is now the worker's backlog
    workers[0].inflight = 1
    second = s.decide(key(text(2, 40_000)), workers)
    assert second.predicted_ttft_s > first.predicted_ttft_s
