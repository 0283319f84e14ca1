"""The canary's Prometheus figures, read at scrape time from ``CanaryWatch`` (nothing on the hot
path): questions asked, faults, holds and whether a replica is held, per worker; the budget per model."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.fleet.registry import Registry
from kvroute.guard.canary_watch import CanaryWatch


class CanaryCollector(Collector):
    """``kvroute_canary_*`` for the replicas still registered."""

    def __init__(self, watch: CanaryWatch, registry: Registry) -> None:
        self._watch = watch
        self._registry = registry

    def describe(self) -> list[Metric]:
        # Built per scrape: the families vary with the fleet.
        return []

    def collect(self) -> Iterator[Metric]:
        questions = CounterMetricFamily("kvroute_canary_questions",
                                        "Canary questions answered, by worker", labels=["worker"])
        wrong = CounterMetricFamily("kvroute_canary_wrong",
                                    "Canary answers counted against the worker (empty, '!!!', or a wrong "
                                    "number where another replica was right)", labels=["worker"])
        holds = CounterMetricFamily("kvroute_canary_holds",
                                    "Times the canary held the worker out of rotation", labels=["worker"])
        held = GaugeMetricFamily("kvroute_canary_held", "1 while the canary holds the worker out of rotation",
                                 labels=["worker"])
        for record in self._registry.records():
            replica = self._watch.replica(record.id)
            if replica is None:
                continue
            wid = [record.id]
            questions.add_metric(wid, replica.questions)
            wrong.add_metric(wid, replica.wrong)
            holds.add_metric(wid, replica.holds)
            held.add_metric(wid, 1.0 if replica.held else 0.0)
        spent = CounterMetricFamily("kvroute_canary_tokens",
                                    "Engine work the canary spent (uncached prompt + completion tokens), "
                                    "by model", labels=["model"])
        allowed = CounterMetricFamily("kvroute_canary_budget_tokens",
                                      "Engine work the canary's budget allowed so far, by model",
                                      labels=["model"])
        for model, budget in sorted(self._watch.budgets().items()):
            spent.add_metric([model], budget["spent_tokens"])
            allowed.add_metric([model], budget["allowed_tokens"])
        yield from (questions, wrong, holds, held, spent, allowed)
