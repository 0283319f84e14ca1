"""The agent-session workload of ``kvroute.bench`` with the session id under every router's header
(or under none, for clients that send no session id: every router must then go by the prompt)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvroute.bench.workloads import AgentWorkload, PlannedRequest, SessionScript
from peers.routers import SESSION_HEADERS


@dataclass(frozen=True, slots=True)
class KeyedRequest(PlannedRequest):
    """A planned request whose headers carry its session id under every name in SESSION_HEADERS."""

    def headers(self) -> dict[str, str]:
        """One header per router family, all with the same session id (none without a session)."""
        return {name: self.session_id for name in SESSION_HEADERS} if self.session_id else {}


@dataclass(frozen=True, slots=True)
class UnkeyedRequest(PlannedRequest):
    """A planned request that tells no router its session (the body never does either)."""

    def headers(self) -> dict[str, str]:
        """No session header at all."""
        return {}


def keyed(req: PlannedRequest, with_ids: bool = True) -> PlannedRequest:
    """``req`` with the headers of every router (``with_ids`` False: with none)."""
    kind = KeyedRequest if with_ids else UnkeyedRequest
    return kind(**{f.name: getattr(req, f.name) for f in dataclasses.fields(req)})


@dataclass(frozen=True, slots=True)
class KeyedWorkload:
    """``inner``'s sessions, byte for byte, with KeyedRequest headers (a ``kvroute.bench`` Workload)."""

    inner: AgentWorkload
    with_ids: bool = True

    @property
    def size(self) -> int | None:
        """As the inner workload (endless)."""
        return self.inner.size

    def session(self, index: int) -> SessionScript:
        """Session ``index`` of the inner workload."""
        script = self.inner.session(index)
        return SessionScript(script.session_id, tuple(keyed(r, self.with_ids) for r in script.requests))
