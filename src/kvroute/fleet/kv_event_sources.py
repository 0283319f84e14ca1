"""Where each worker publishes its KV-cache events: named per worker, or templates filled with the
worker's host (settings only; the subscriber is fleet/kv_events.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvroute.fleet.kv_event_wire import offset_endpoint_port


@dataclass(frozen=True, slots=True)
class KvEndpoint:
    """Where one worker publishes: the PUB endpoint and (optionally) the replay endpoint of rank
    0, the number of data-parallel ranks (each on the ports + rank, as vLLM does) and the topic."""

    endpoint: str
    replay: str | None = None
    ranks: int = 1
    topic: str = ""

    def of_rank(self, rank: int) -> tuple[str, str | None]:
        """The PUB and replay endpoints of ``rank``."""
        pub = offset_endpoint_port(self.endpoint, rank)
        assert pub is not None
        return pub, offset_endpoint_port(self.replay, rank)


def parse_endpoint_spec(spec: str, *, ranks: int = 1, topic: str = "") -> KvEndpoint:
    """``PUB[,REPLAY]`` (``tcp://host:5557,tcp://host:5558``) as a ``KvEndpoint``; ValueError
    naming the problem."""
    parts = [p.strip() for p in spec.split(",")]
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise ValueError(f"KV events endpoint {spec!r}: expected PUB[,REPLAY]")
    for part in parts:
        if not part.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"KV events endpoint {part!r}: expected tcp://HOST:PORT (or ipc://, inproc://)")
    return KvEndpoint(parts[0], parts[1] if len(parts) == 2 else None, ranks, topic)


def endpoint_for(url: str, template: str) -> str:
    """``template`` (``tcp://{host}:5557``) filled with the host of the worker's ``url``."""
    host = urlsplit(url).hostname or ""
    shown = f"[{host}]" if ":" in host else host
    return template.replace("{host}", shown)


@dataclass(frozen=True, slots=True)
class KvEventSettings:
    """Where workers publish: ``explicit`` (worker URL or id -> ``PUB[,REPLAY]``; ``off``: none),
    else ``endpoint``/``replay`` templates filled with the worker's host (empty: none), ``ranks``
    data-parallel ranks per worker and the ``topic``."""

    explicit: Mapping[str, str] = field(default_factory=dict)
    endpoint: str = "tcp://{host}:5557"
    replay: str = ""
    ranks: int = 1
    topic: str = ""

    def for_worker(self, worker_id: str, url: str) -> tuple[KvEndpoint | None, bool]:
        """The worker's endpoint and whether it came from the templates (None: it publishes none)."""
        spec = self.explicit.get(url, self.explicit.get(worker_id))
        if spec is not None:
            if spec.strip().lower() in ("", "off", "none"):
                return None, False
            return parse_endpoint_spec(spec, ranks=self.ranks, topic=self.topic), False
        if not self.endpoint:
            return None, False
        replay = endpoint_for(url, self.replay) if self.replay else None
        return KvEndpoint(endpoint_for(url, self.endpoint), replay, self.ranks, self.topic), True
