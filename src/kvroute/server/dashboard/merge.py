"""The dashboard of a router made of several processes (``kvroute serve --processes N``).

The fleet — workers, engine figures, the prefix index and sessions — is the same in every process
(the index and sessions are shared through Redis), but each process keeps its own recent requests,
TTFB samples, per-worker request counts and in-flight counts, and its own flow-control queues.
``activity_json`` is one process's share, as its siblings fetch it; ``merged_view`` folds the
siblings' shares into the answering process's view, from which the usual snapshot is built.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, TypeVar

from kvroute.server.activity import QueueSample, RoutedRequest
from kvroute.server.context import Router
from kvroute.server.dashboard.snapshot import FleetView, QueueView
from kvroute.server.dashboard.views import local_queue

log = logging.getLogger("kvroute.dashboard")


def activity_json(router: Router) -> dict[str, Any]:
    """This process's recent requests, TTFB samples, requests and in-flight counts per worker, and
    its flow-control queues (depth now, by class, session admission's door, admitted and shed
    counts, waits, depth history)."""
    queue = local_queue(router)
    return {
        "requests": [r.to_json() for r in router.activity.requests],
        "ttfb": list(router.activity.ttfb),
        "workers": {r.id: {"inflight": r.state.inflight, "requests": dict(r.requests)}
                    for r in router.registry.records()},
        "queue": {
            "depth": {m: list(d) for m, d in queue.depth.items()},
            "by_class": [[m, cls, n, t] for (m, cls), (n, t) in queue.by_class.items()],
            "sessions": {m: list(c) for m, c in queue.sessions.items()},
            "tenant_tokens": [[m, t, n] for (m, t), n in queue.tenant_tokens.items()],
            "admitted": [[m, when, n] for (m, when), n in queue.admitted.items()],
            "shed": [[m, reason, n] for (m, reason), n in queue.shed.items()],
            "waits": list(queue.waits),
            "saturation": {m: list(c) for m, c in queue.saturation.items()},
            "history": {m: [s.to_json() for s in samples]
                        for m, samples in router.activity.queue.history.items()},
        },
    }


@dataclasses.dataclass(slots=True)
class _Activity:
    requests: list[RoutedRequest]
    ttfb: list[tuple[float, float]]
    inflight: dict[str, int]
    counts: dict[str, Counter[str]]
    queue: QueueView


def _parse(doc: Mapping[str, Any]) -> _Activity:
    """A sibling's ``activity_json``; raises (TypeError, ValueError, KeyError) when malformed."""
    workers = doc["workers"]
    counts = {str(w): Counter({str(k): int(n) for k, n in v["requests"].items()}) for w, v in workers.items()}
    return _Activity(
        requests=[RoutedRequest(**r) for r in doc["requests"]],
        ttfb=[(float(t), float(v)) for t, v in doc["ttfb"]],
        inflight={str(w): int(v["inflight"]) for w, v in workers.items()},
        counts=counts,
        queue=_parse_queue(doc.get("queue", {})),
    )


def _parse_queue(doc: Mapping[str, Any]) -> QueueView:
    """A sibling's queue share (absent from an older process: empty)."""
    return QueueView(
        depth={str(m): (int(d[0]), int(d[1])) for m, d in doc.get("depth", {}).items()},
        by_class={(str(m), str(c)): (int(n), int(t)) for m, c, n, t in doc.get("by_class", [])},
        sessions={str(m): (int(c[0]), int(c[1])) for m, c in doc.get("sessions", {}).items()},
        tenant_tokens={(str(m), str(t)): int(n) for m, t, n in doc.get("tenant_tokens", [])},
        admitted={(str(m), str(w)): int(n) for m, w, n in doc.get("admitted", [])},
        shed={(str(m), str(r)): int(n) for m, r, n in doc.get("shed", [])},
        waits=[(float(t), str(m), float(v)) for t, m, v in doc.get("waits", [])],
        history={str(m): [[QueueSample(*(int(x) for x in s)) for s in samples]]
                 for m, samples in doc.get("history", {}).items()},
        saturation={str(m): (int(c[0]), int(c[1])) for m, c in doc.get("saturation", {}).items()},
    )


K = TypeVar("K")


def _summed_pairs(maps: Iterable[Mapping[K, tuple[int, int]]]) -> dict[K, tuple[int, int]]:
    """(count, tokens)-style pairs summed key by key over every process."""
    out: dict[K, tuple[int, int]] = {}
    for m in maps:
        for key, (a, b) in m.items():
            was = out.get(key, (0, 0))
            out[key] = (was[0] + a, was[1] + b)
    return out


def _merged_queue(views: Sequence[QueueView]) -> QueueView:
    """Every process's queues: depths and counts summed (session admission's door and the processes
    that see the fleet saturated too: each process keeps its own), waits interleaved by time, one
    depth timeline per process (the series sums them)."""
    admitted: Counter[tuple[str, str]] = Counter()
    shed: Counter[tuple[str, str]] = Counter()
    tenant_tokens: Counter[tuple[str, str]] = Counter()
    history: dict[str, list[Any]] = {}
    for v in views:
        admitted.update(v.admitted)
        tenant_tokens.update(v.tenant_tokens)
        shed.update(v.shed)
        for m, timelines in v.history.items():
            history.setdefault(m, []).extend(timelines)
    waits = sorted(chain.from_iterable(v.waits for v in views))
    return QueueView(depth=_summed_pairs(v.depth for v in views),
                     by_class=_summed_pairs(v.by_class for v in views),
                     sessions=_summed_pairs(v.sessions for v in views),
                     tenant_tokens=dict(tenant_tokens),
                     admitted=dict(admitted), shed=dict(shed), waits=waits, history=history,
                     saturation=_summed_pairs(v.saturation for v in views))


def merged_view(router: Router, others: Sequence[Mapping[str, Any]]) -> FleetView:
    """The answering process's view with the other processes' activity folded in: requests and
    in-flight counts per worker summed, recent requests and TTFB samples interleaved by time.
    ``peer_inflight`` keeps only what router instances outside this router have in flight."""
    shares: list[_Activity] = []
    for doc in others:
        try:
            shares.append(_parse(doc))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            log.warning("dashboard: ignoring a router process's malformed activity: %s", exc)
    records = []
    for record in router.registry.records():
        extra = sum(s.inflight.get(record.id, 0) for s in shares)
        counts = Counter(record.requests)
        for s in shares:
            counts.update(s.counts.get(record.id, Counter()))
        state = dataclasses.replace(record.state, inflight=record.state.inflight + extra,
                                    peer_inflight=max(0, record.state.peer_inflight - extra))
        records.append(dataclasses.replace(record, state=state, requests=counts))
    requests = sorted(chain(router.activity.requests, *(s.requests for s in shares)), key=lambda r: r.time)
    ttfb = sorted(chain(router.activity.ttfb, *(s.ttfb for s in shares)))
    queue = _merged_queue([local_queue(router), *(s.queue for s in shares)])
    return FleetView(records=records, scheduler_stats=router.scheduler.stats(),
                     routing=router.scheduler.config, requests=requests, ttfb=ttfb, queue=queue,
                     guard=router.guard_json)
