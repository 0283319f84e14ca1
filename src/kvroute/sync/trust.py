"""Which messages from the Redis streams are believed: their signature, then what they claim.

Anyone who can write to the Redis instance can append to the streams, so a message is judged in
two steps before anything in it is used (docs/multi-instance.md#trust-model):

* **Signature.** With a shared secret, every message carries ``HMAC-SHA256(secret, body)`` in the
  stream entry's ``sig`` field (hex), and a message without one (``unsigned``) or with a wrong one
  (``bad_signature``) is dropped before its JSON is even parsed.  One HMAC per message, not per
  record: a batch of facts is signed once.
* **Bounds**, even on a signed message, because a signed peer can be buggy or compromised and a
  fact that got in persists (a session bound in 2058 never expires, a worker's epoch only moves
  forward): no time or epoch later than the receiver's clock plus ``max_skew_s`` (``future_time``,
  ``future_epoch``; an epoch this instance already holds for the worker is no claim, so a replica
  host whose clock runs ahead is not refused), no heartbeat older than its validity plus the skew
  when read live (``stale``: a replay), no worker with more in flight than its sequence slots times
  the live router instances (``implausible_load``); and a prefix fact's prefill estimate is capped
  at the worker's context window (``within_context``).

Checks raise ``MessageError`` with the reason, so a message is rejected whole: a rejected message
changes nothing.  Pure: no I/O; the clock is passed in.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Callable, Mapping
from typing import Any

from kvroute.routing.sync_record import PrefixRecord, SessionRecord, SyncRecord
from kvroute.sync.messages import FIELD, FactsMessage, LoadMessage, MessageError

SIGNATURE_FIELD = b"sig"
# A secret anyone can guess from the streams' (body, signature) pairs protects nothing.
MIN_SECRET_BYTES = 16


class Signer:
    """Signs outgoing messages and checks incoming ones with the shared ``secret`` (None: no
    secret: nothing is signed and every message is taken as unsigned, whatever it carries)."""

    def __init__(self, secret: bytes | None) -> None:
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the sync secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret

    @property
    def enabled(self) -> bool:
        """Whether messages are signed and checked."""
        return self._secret is not None

    def fields(self, payload: bytes) -> dict[Any, Any]:
        """The stream entry's fields for ``payload``: the body, and its signature with a secret."""
        if self._secret is None:
            return {FIELD: payload}
        return {FIELD: payload, SIGNATURE_FIELD: self._mac(payload)}

    def verify(self, fields: Mapping[Any, Any]) -> None:
        """Raise ``MessageError`` unless the entry is signed with the secret (no-op without one)."""
        if self._secret is None:
            return
        sig = _field(fields, SIGNATURE_FIELD)
        if sig is None:
            raise MessageError("unsigned", "the message carries no signature")
        payload = _field(fields, FIELD)
        if payload is None:
            raise MessageError("malformed", f"the entry has no {FIELD.decode()!r} field")
        if not hmac.compare_digest(sig, self._mac(payload)):
            raise MessageError("bad_signature", "the signature does not match (another secret?)")

    def _mac(self, payload: bytes) -> bytes:
        assert self._secret is not None
        return hmac.digest(self._secret, payload, "sha256").hex().encode()


def _field(fields: Mapping[Any, Any], name: bytes) -> bytes | None:
    raw = fields.get(name, fields.get(name.decode()))
    if isinstance(raw, str):
        return raw.encode()
    return raw if isinstance(raw, bytes) else None


def check_facts(msg: FactsMessage, *, now: float, max_skew_s: float,
                held_epoch: Callable[[str], float | None]) -> None:
    """Raise ``MessageError`` if a facts message claims a time or an epoch in the future.

    ``held_epoch(worker)`` is the epoch this instance already uses for the worker (None if none)."""
    latest = now + max_skew_s
    if msg.time > latest:
        raise MessageError("future_time", f"sent at {msg.time:.0f}, later than now plus the clock skew")
    for record in msg.records:
        if isinstance(record, PrefixRecord | SessionRecord) and record.time > latest:
            raise MessageError("future_time", f"a {record.TYPE} fact stamped {record.time:.0f}, later than "
                                              "now plus the clock skew")
        if isinstance(record, SessionRecord):
            continue
        _check_epoch(record.worker_id, record.epoch, latest, held_epoch)


def check_load(msg: LoadMessage, *, now: float, max_skew_s: float, live: bool,
               held_epoch: Callable[[str], float | None], max_inflight: Callable[[str], int]) -> None:
    """Raise ``MessageError`` if a heartbeat is from the future, a replay (``live``: read as it was
    sent, not from the history), or claims more in flight on a worker than ``max_inflight(worker)``."""
    latest = now + max_skew_s
    if msg.time > latest:
        raise MessageError("future_time", f"sent at {msg.time:.0f}, later than now plus the clock skew")
    if live and msg.time + msg.ttl_s + max_skew_s < now:
        raise MessageError("stale", f"a heartbeat sent {now - msg.time:.0f} s ago (a replay?)")
    for wid, load in msg.workers.items():
        _check_epoch(wid, load.epoch, latest, held_epoch)
        bound = max_inflight(wid)
        if load.inflight > bound:
            raise MessageError("implausible_load",
                               f"{load.inflight} in flight on {wid}, more than {bound} (its sequence slots "
                               "times the live router instances)")


def within_context(record: SyncRecord, max_model_len: int | None) -> SyncRecord:
    """``record`` with a prefix fact's prefill estimate at most the worker's context window (when
    known): no request makes a worker prefill more, and the excess would count as its backlog."""
    if isinstance(record, PrefixRecord) and max_model_len is not None \
            and record.prefill_tokens > max_model_len:
        return dataclasses.replace(record, prefill_tokens=max_model_len)
    return record


def _check_epoch(worker_id: str, epoch: float, latest: float,
                 held_epoch: Callable[[str], float | None]) -> None:
    if epoch > latest and epoch != held_epoch(worker_id):
        raise MessageError("future_epoch", f"epoch {epoch:.0f} for {worker_id}, later than now plus the "
                                           "clock skew")
