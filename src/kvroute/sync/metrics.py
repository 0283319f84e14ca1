"""The sync bus's Prometheus metrics, on the router's own registry (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvroute.routing.sync_record import PrefixRecord, SessionRecord, WorkerEpochRecord

# Every reason a fact or message can be dropped, pre-created so each series exists from the start.
DROP_REASONS = (
    "queue_full",      # records: the local send queue was full (Redis slow or down for long)
    "send_error",      # records: Redis refused the batch with a non-connection error
    "pending_full",    # records: held for a worker not registered here, evicted unapplied
    "malformed",       # messages: not JSON, wrong shape, bad record
    "version",         # messages: another protocol version
)
RECORD_KINDS = (PrefixRecord.TYPE, SessionRecord.TYPE, WorkerEpochRecord.TYPE)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SyncMetrics:
    """``kvroute_sync_*``: connection state, facts published/applied, drops by reason, lag, peers."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.connected = Gauge("kvroute_sync_connected", "1 while this instance is connected to Redis",
                               registry=registry)
        self.published = Counter("kvroute_sync_published",
                                 "Routing facts (records) sent to the other instances, by kind",
                                 ["kind"], registry=registry)
        self.applied = Counter("kvroute_sync_applied",
                               "Routing facts (records) from other instances applied here, by kind",
                               ["kind"], registry=registry)
        self.dropped = Counter("kvroute_sync_dropped",
                               "Facts (records) or received messages dropped, by reason",
                               ["reason"], registry=registry)
        self.lag = Histogram("kvroute_sync_lag_seconds",
                             "Age of a live facts message when applied here (sender's clock to ours)",
                             buckets=LAG_BUCKETS, registry=registry)
        self.peers = Gauge("kvroute_sync_peers", "Other instances whose load heartbeat is live",
                           registry=registry)
        self.heartbeats = Counter("kvroute_sync_heartbeats", "Load heartbeats sent", registry=registry)
        self.outages = Counter("kvroute_sync_outages", "Times the connection to Redis was lost or refused",
                               registry=registry)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for kind in RECORD_KINDS:
            self.published.labels(kind)
            self.applied.labels(kind)
