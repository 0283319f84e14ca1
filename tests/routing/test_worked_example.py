"""The worked example of docs/design.md ("a new scorer"), as written there: one module's worth of
code registered with one call, then configured and routed through like any built-in policy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from routing_helpers import Clock, fleet, key, text

from kvroute.router_settings import Settings
from kvroute.routing import filters, pickers, policies, scorers
from kvroute.routing.decision import DecisionKind
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.settings import setting
from kvroute.routing.stages import Policy, Scorer
from kvroute.routing.view import Candidate, View

# --- routing/policies/kv_first.py, as in docs/design.md ----------------------------------------


@dataclass(frozen=True, slots=True)
class KvFirstSettings:
    kv_full_at: float = setting(0.9, "KV usage at which a replica counts as full")


def _kv_headroom(view: View, cands: list[Candidate]) -> list[float]:
    full = view.block(KvFirstSettings).kv_full_at
    return [1.0 if (c.worker.kv_usage or 0.0) >= full else 0.0 for c in cands]


kv_headroom = Scorer("kv_headroom", _kv_headroom)  # reads only the worker's own figures


def _explain(view: View, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    c = cands[i]
    return DecisionKind.BALANCE, f"[KV-FIRST] {c.worker.id} kv={c.worker.kv_usage} load={c.load}"


POLICY = Policy("kv-first", filters.BASE, (kv_headroom, scorers.engine_load), pickers.lowest, _explain,
                settings=(KvFirstSettings,), summary="replicas below kv_full_at first, then least loaded")

# -------------------------------------------------------------------------------------------------


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The example registered for one test (the registry is process-wide; the settings groups
    are computed from it when asked, so the policy's block leaves with it)."""
    monkeypatch.setitem(policies.POLICIES, POLICY.name, POLICY)
    yield


@pytest.mark.parametrize(("usage", "loads", "expected"), [
    ((0.95, 0.2, 0.5), (0, 3, 1), "w2"),  # w0 is full; of the others the less loaded
    ((0.1, 0.2, 0.5), (2, 3, 1), "w2"),  # nobody full: least loaded
    ((0.95, 0.99, 0.91), (2, 3, 1), "w2"),  # everybody full: least loaded all the same
])
def test_kv_first_routes_as_its_scorers_say(registered: None, usage: tuple[float, ...],
                                            loads: tuple[int, ...], expected: str) -> None:
    settings = Settings.from_dict({"policy": "kv-first", "routing": {"kv_full_at": 0.9}})
    s = Scheduler(settings.routing_config(), clock=Clock())
    ws = fleet(3)
    for w, u, n in zip(ws, usage, loads, strict=True):
        w.kv_usage, w.inflight = u, n
    d = s.decide(key(text(1, 4000)), ws)
    assert d.worker_id == expected and d.reason.startswith("[KV-FIRST]")


def test_kv_first_settings_are_validated_and_per_model(registered: None) -> None:
    settings = Settings.from_dict({"policy": "kv-first", "models": {"big": {"kv_full_at": 0.5}}})
    routing = settings.routing_config()
    assert routing.default.kv_full_at == 0.9 and routing.settings_for("big").kv_full_at == 0.5
    with pytest.raises(ValueError, match="kv_full_at"):
        Settings.from_dict({"routing": {"kv_full_at": "lots"}}).routing_config()
