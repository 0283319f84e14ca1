"""The priority class and tenant flow control reads from a request's headers (api/requests.py)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from kvroute.api.errors import ApiError
from kvroute.api.requests import RequestHeaders, RequestOptions, parse_request, priority_of, tenant_of

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("value, expected", [
    ("high", 1), ("HIGH", 1), (" normal ", 0), ("low", -1), ("1", 1), ("0", 0), ("-1", -1),
])
def test_priority_values(value: str, expected: int) -> None:
    assert priority_of(CIMultiDict({"X-KVRoute-Priority": value})) == expected
    assert parse_request("chat", BODY, {"x-kvroute-priority": value}).priority == expected


def test_no_priority_header_is_normal() -> None:
    assert parse_request("chat", BODY, {}).priority == 0


@pytest.mark.parametrize("value", ["urgent", "2", "", "1.0", "hi gh"])
def test_a_bad_priority_is_a_400_naming_the_header(value: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request("messages", {**BODY, "max_tokens": 5}, {"x-kvroute-priority": value})
    assert caught.value.status == 400 and caught.value.param == "x-kvroute-priority"
    assert "high, normal, low" in caught.value.message


@pytest.mark.parametrize("headers, expected", [
    ({"x-kvroute-tenant": "team-a", "x-gateway-inference-fairness-id": "b", "x-api-key": "k"}, "team-a"),
    ({"x-gateway-inference-fairness-id": "llm-d-b", "authorization": "Bearer sk-1"}, "llm-d-b"),
    ({"x-kvroute-tenant": "  "}, None),
    ({}, None),
])
def test_tenant_sources_in_order(headers: dict[str, str], expected: str | None) -> None:
    assert tenant_of(CIMultiDict(headers)) == expected


def test_an_api_key_is_a_tenant_only_as_a_hash() -> None:
    secret = "sk-live-0123456789abcdef"
    by_bearer = tenant_of({"Authorization": f"Bearer {secret}"})
    by_header = tenant_of({"x-api-key": secret})
    other = tenant_of({"x-api-key": secret + "x"})
    assert by_bearer == by_header != other
    assert by_bearer is not None and by_bearer.startswith("key:") and secret not in by_bearer
    assert len(by_bearer) == len("key:") + 16
    assert tenant_of({"authorization": "Basic abc"}) is None
    key = parse_request("chat", BODY, {"x-api-key": secret})
    assert key.tenant == by_header and secret not in repr(key)


@pytest.mark.parametrize("pairs", [
    [(b"Host", b"x"), (b"X-KVRoute-Priority", b"low"), (b"Authorization", b"Bearer sk-1")],
    [(b"x-session-id", b"first"), (b"X-Session-Id", b"second"), (b"X-Claude-Code-Agent-Id", b"a1")],
    [(b"X-Conversation", b"c7"), (b"x-kvroute-tenant", b"t"), (b"X-KVROUTE-TENANT", b"u")],
    [(b"X-Api-Key", b"k\xe9y"), (b"session_id", b"s")],
    [],
])
def test_the_fronts_header_dict_reads_as_a_multidict(pairs: list[tuple[bytes, bytes]]) -> None:
    # The listening side hands parse_request a plain dict (RequestHeaders), cheaper than the
    # CIMultiDict it replaces: the same key, whatever the names' case and repeats.
    multi = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in pairs)
    options = RequestOptions(extra_session_headers=("X-Conversation",))
    for route, body in (("chat", BODY), ("messages", {**BODY, "max_tokens": 5})):
        assert (parse_request(route, body, RequestHeaders.of(pairs), options)
                == parse_request(route, body, multi, options))
