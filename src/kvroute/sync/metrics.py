"""The sync bus's Prometheus metrics, on the router's own registry (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvroute.routing.sync_record import PrefixRecord, SessionRecord, WorkerEpochRecord

# Every reason a fact of this instance's own can be lost, pre-created so each series exists from
# the start.
DROP_REASONS = (
    "queue_full",      # the local send queue was full (Redis slow or down for long)
    "send_error",      # Redis refused the batch with a non-connection error
    "pending_full",    # held for a worker not registered here, evicted unapplied
)
# Every reason a received message is rejected whole (sync/trust.py, sync/messages.py).
REJECT_REASONS = (
    "unsigned",          # a secret is set and the message carries no signature
    "bad_signature",     # signed with another secret, or altered
    "malformed",         # not JSON, wrong shape, bad record
    "version",           # another protocol version
    "future_time",       # sent or stamped later than now plus the clock skew
    "future_epoch",      # a worker epoch later than now plus the clock skew
    "stale",             # a heartbeat read live long after it ran out: a replay
    "implausible_load",  # more in flight on a worker than its slots times the live instances
    "unknown_instance",  # a heartbeat from an instance that holds no connection to Redis
)
RECORD_KINDS = (PrefixRecord.TYPE, SessionRecord.TYPE, WorkerEpochRecord.TYPE)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SyncMetrics:
    """``kvroute_sync_*``: connection state, facts published/applied, drops and rejections by reason, lag,
    peers."""

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
                               "Facts (records) of this instance's own lost before they counted, by reason",
                               ["reason"], registry=registry)
        self.rejected = Counter("kvroute_sync_rejected",
                                "Messages from the Redis streams rejected whole, by reason",
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
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for kind in RECORD_KINDS:
            self.published.labels(kind)
            self.applied.labels(kind)
