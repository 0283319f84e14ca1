"""What a remote message must be to be believed: signed with the secret, and plausible even then
(sync/trust.py).  Pure: no Redis."""

from __future__ import annotations

import hmac

import pytest

from kvroute.routing.sync_record import PrefixRecord, SessionRecord, WorkerEpochRecord
from kvroute.sync.messages import FIELD, FactsMessage, LoadMessage, MessageError, WorkerLoad, encode_facts
from kvroute.sync.trust import SIGNATURE_FIELD, Signer, check_facts, check_load, within_context

SECRET = b"0123456789abcdef-the-shared-one"
NOW = 1_800_000_000.0
SKEW = 60.0
FAR = 2_845_000_000.0  # 2060: the forged epoch of issue 24


def _reason(call: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(MessageError) as info:
        call(*args, **kwargs)  # type: ignore[operator]
    return str(info.value.reason)


def test_signed_entries_verify_and_anything_else_is_named() -> None:
    signer = Signer(SECRET)
    payload = encode_facts(FactsMessage("a", NOW, (SessionRecord(1, "w", NOW),)))
    fields = signer.fields(payload)
    assert fields[FIELD] == payload
    assert fields[SIGNATURE_FIELD] == hmac.new(SECRET, payload, "sha256").hexdigest().encode()
    signer.verify(fields)
    signer.verify({k.decode(): v.decode() for k, v in fields.items()})  # str keys and values too
    assert _reason(signer.verify, {FIELD: payload}) == "unsigned"
    assert _reason(signer.verify, Signer(b"another secret, 16+ bytes").fields(payload)) == "bad_signature"
    tampered = {FIELD: payload.replace(b'"a"', b'"b"'), SIGNATURE_FIELD: fields[SIGNATURE_FIELD]}
    assert _reason(signer.verify, tampered) == "bad_signature"
    assert _reason(signer.verify, {SIGNATURE_FIELD: fields[SIGNATURE_FIELD]}) == "malformed"
    assert _reason(signer.verify, {FIELD: payload, SIGNATURE_FIELD: b""}) == "bad_signature"


def test_without_a_secret_nothing_is_signed_and_nothing_checked() -> None:
    signer = Signer(None)
    assert not signer.enabled
    assert signer.fields(b"{}") == {FIELD: b"{}"}
    signer.verify({FIELD: b"{}", SIGNATURE_FIELD: b"whatever"})
    signer.verify({FIELD: b"{}"})


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Signer(b"short")


def _facts(*records: PrefixRecord | SessionRecord | WorkerEpochRecord, t: float = NOW) -> FactsMessage:
    return FactsMessage("peer", t, records)


def test_facts_from_the_future_are_rejected_whole() -> None:
    held = {"w1": 1_000.0}.get
    check = dict(now=NOW, max_skew_s=SKEW, held_epoch=held)
    check_facts(_facts(PrefixRecord("w1", NOW + SKEW, NOW + SKEW, (1,)), SessionRecord(1, "w1", NOW)),
                **check)
    assert _reason(check_facts, _facts(WorkerEpochRecord("w1", FAR)), **check) == "future_epoch"
    assert _reason(check_facts, _facts(SessionRecord(1, "w1", NOW), WorkerEpochRecord("w2", NOW + SKEW + 1)),
                   **check) == "future_epoch"
    assert _reason(check_facts, _facts(PrefixRecord("w1", 1_000.0, FAR, (1,))), **check) == "future_time"
    assert _reason(check_facts, _facts(SessionRecord(1, "w1", FAR)), **check) == "future_time"
    assert _reason(check_facts, _facts(t=FAR), **check) == "future_time"


def test_an_epoch_already_held_here_is_no_claim() -> None:
    # A replica host whose clock runs ahead: its engine's start time is the epoch every instance
    # probing it holds; a peer naming the same one is not refused.
    ahead = NOW + 3600
    check_facts(_facts(WorkerEpochRecord("w1", ahead)), now=NOW, max_skew_s=SKEW,
                held_epoch={"w1": ahead}.get)
    assert _reason(check_facts, _facts(WorkerEpochRecord("w1", ahead + 1)), now=NOW, max_skew_s=SKEW,
                   held_epoch={"w1": ahead}.get) == "future_epoch"


def _load(t: float = NOW, ttl: float = 1.0, **workers: tuple[int, float]) -> LoadMessage:
    return LoadMessage("peer", t, ttl, {w: WorkerLoad(n, e) for w, (n, e) in workers.items()})


def test_heartbeats_are_bounded_in_time_epoch_and_load() -> None:
    check = dict(now=NOW, max_skew_s=SKEW, live=True, held_epoch=lambda w: None,
                 max_inflight=lambda w: 256 * 3)
    check_load(_load(w1=(768, NOW - 10), w2=(0, NOW + SKEW)), **check)
    assert _reason(check_load, _load(w1=(769, NOW)), **check) == "implausible_load"
    assert _reason(check_load, _load(w1=(5000, NOW), w2=(5000, NOW)), **check) == "implausible_load"
    assert _reason(check_load, _load(w1=(1, FAR)), **check) == "future_epoch"
    assert _reason(check_load, _load(t=NOW + SKEW + 0.5), **check) == "future_time"
    # Read live, a heartbeat is stale once its validity and the skew have both passed: a replay.
    check_load(_load(t=NOW - SKEW - 0.9, ttl=1.0), **check)
    assert _reason(check_load, _load(t=NOW - SKEW - 1.1, ttl=1.0), **check) == "stale"
    # From the history (catch-up) its age is what counts, not staleness.
    check_load(_load(t=NOW - 3600), **{**check, "live": False})


def test_the_load_bound_is_per_worker() -> None:
    bounds = {"small": 4, "big": 1024}
    check = dict(now=NOW, max_skew_s=SKEW, live=True, held_epoch=lambda w: None,
                 max_inflight=bounds.__getitem__)
    check_load(_load(big=(1000, NOW), small=(4, NOW)), **check)
    assert _reason(check_load, _load(big=(10, NOW), small=(5, NOW)), **check) == "implausible_load"


def test_a_prefill_estimate_is_capped_at_the_context_window() -> None:
    big = PrefixRecord("w1", 1.0, NOW, (1, 2), prefill_tokens=10**9)
    assert within_context(big, 40_960).prefill_tokens == 40_960
    assert within_context(big, 40_960).hashes == big.hashes
    assert within_context(big, None) is big  # the window unknown: as sent
    small = PrefixRecord("w1", 1.0, NOW, (1,), prefill_tokens=40_960)
    assert within_context(small, 40_960) is small
    session = SessionRecord(1, "w1", NOW)
    assert within_context(session, 1) is session
