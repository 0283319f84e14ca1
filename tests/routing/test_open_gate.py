"""The dispatcher's path while flow control's gate is not engaged (routing/dispatch.py): every
request gets the one shared, read-only granted ticket (no ticket or prediction per request), and
the rest of its life is what it was with a ticket of its own.  Pure: an injected clock."""

from __future__ import annotations

import pytest
from routing_helpers import Clock
from test_flow import dispatcher, fleet, key, send

from kvroute.routing import flow_queue
from kvroute.routing.dispatch import GRANTED_AT_ONCE
from kvroute.routing.flow import TicketState


def test_an_open_gate_hands_out_the_shared_ticket(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(0.0)
    d = dispatcher(clock, flow_control=False)
    workers = fleet(1, seqs=1)
    made: list[object] = []
    init = flow_queue.Ticket.__init__

    def counted(self: flow_queue.Ticket, *args: object, **kwargs: object) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(flow_queue.Ticket, "__init__", counted)
    told: list[object] = []
    tickets = [d.admit(key(text=f"r{i}"), workers, told.append) for i in range(3)]  # one replica, 3 requests
    for i in range(3):
        send(d, key(text=f"r{i}"), workers)
    assert all(t is GRANTED_AT_ONCE for t in tickets) and made == [] and told == []
    assert GRANTED_AT_ONCE.state is TicketState.GRANTED and GRANTED_AT_ONCE.why == "" and \
        GRANTED_AT_ONCE.on_decided is None and GRANTED_AT_ONCE.waited_s == 0.0
    with pytest.raises(AttributeError):
        GRANTED_AT_ONCE.on_decided = told.append
    d.withdraw(GRANTED_AT_ONCE)  # nothing of it was recorded: a no-op
    assert GRANTED_AT_ONCE.state is TicketState.GRANTED


def test_an_engaged_gate_still_gives_each_request_its_own_ticket() -> None:
    clock = Clock(0.0)
    d = dispatcher(clock)  # flow_control true
    workers = fleet(1, seqs=1)
    first = d.admit(key(text="a"), workers)
    send(d, key(text="a"), workers)
    second = d.admit(key(text="b"), workers)
    assert first is not GRANTED_AT_ONCE and first.state is TicketState.GRANTED
    assert second is not GRANTED_AT_ONCE and second.queued
