"""The router's own API keys (``api_keys``, ``--api-key``, ``--api-key-file``) on the inference
routes and ``/v1/models``.

OpenAI's SDKs send ``Authorization: Bearer KEY``, Anthropic's ``x-api-key: KEY`` (Claude Code sends
one or the other, by how it was given its key): either header is accepted on every route.  Keys
are compared in constant time, every configured key each time.  A missing or wrong key gets 401
in the API's own format: OpenAI's ``invalid_request_error`` / ``invalid_api_key``, Anthropic's
``authentication_error`` (what each SDK raises as ``AuthenticationError``).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import orjson

from kvroute.api.errors import ApiStyle

Header = tuple[bytes, bytes]
# What a client authenticates with; the router does not pass either on to the workers when it
# checks keys of its own (the workers get worker_api_key, if any).
CLIENT_KEY_HEADERS = frozenset((b"authorization", b"x-api-key"))
# x-should-retry: false, as Anthropic's API sends it: its SDKs and Claude Code (which otherwise retries
# a 401 for minutes) give up at once and say the key is wrong.
_HEADERS_401 = b"content-type: application/json\r\nwww-authenticate: Bearer\r\nx-should-retry: false\r\n"


class KeyCheck:
    """Whether a request carries one of the configured keys."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("KeyCheck needs at least one key")
        self._keys = tuple(k.encode() for k in keys)

    def given(self, headers: Sequence[Header]) -> list[bytes]:
        """The keys a request offers: a Bearer token and an ``x-api-key`` value."""
        found = []
        for name, value in headers:
            lname = name.lower()
            if lname == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer" and token.strip():
                    found.append(token.strip())
            elif lname == b"x-api-key" and value.strip():
                found.append(value.strip())
        return found

    def allows(self, headers: Sequence[Header]) -> bool:
        """Whether any key offered is a configured one."""
        ok = False
        for offered in self.given(headers):
            for key in self._keys:
                # Every pair is compared (no early exit), each in constant time.
                ok |= hmac.compare_digest(offered, key)
        return ok

    def rejection(self, headers: Sequence[Header], style: ApiStyle) -> tuple[bytes, bytes]:
        """The 401's headers and body for a request ``allows`` refused."""
        missing = not self.given(headers)
        if style == "anthropic":
            message = ("no API key: send x-api-key: KEY (or Authorization: Bearer KEY)" if missing
                       else "invalid x-api-key")
            body = {"type": "error", "error": {"type": "authentication_error", "message": message}}
        else:
            message = ("You didn't provide an API key: send Authorization: Bearer KEY" if missing
                       else "Incorrect API key provided.")
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                              "code": "invalid_api_key"}}
        return _HEADERS_401, orjson.dumps(body)
