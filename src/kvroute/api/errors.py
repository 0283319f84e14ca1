"""Error bodies in each API's own format, so clients' SDKs raise the right exception types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import orjson

ApiStyle = Literal["openai", "anthropic"]

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}


@dataclass(slots=True)
class ApiError(Exception):
    """An error to report to the client with ``status`` in the style of the route it called."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


def error_body(style: ApiStyle, status: int, message: str, param: str | None = None,
               code: str | None = None) -> bytes:
    """Render an error the way the OpenAI or Anthropic API would."""
    if style == "anthropic":
        etype = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return orjson.dumps({"type": "error", "error": {"type": etype, "message": message}})
    etype = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps(
        {"error": {"message": message, "type": etype, "param": param, "code": code or status}}
    )
