"""The inference endpoints the router serves, and the API style each one speaks."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.api.errors import ApiStyle


@dataclass(frozen=True, slots=True)
class Route:
    """One proxied endpoint: ``name`` is what ``parse_request`` expects, ``style`` the error format."""

    name: str
    path: str
    style: ApiStyle

    @property
    def sse_error_event(self) -> bool:
        """Whether a stream on this route reports errors as a named ``event: error`` (Anthropic and
        the Responses API) rather than as a bare ``data: {"error": ...}`` (chat and completions)."""
        return self.style == "anthropic" or self.name == "responses"


HTTP_ROUTES: tuple[Route, ...] = (
    Route("chat", "/v1/chat/completions", "openai"),
    Route("completions", "/v1/completions", "openai"),
    Route("messages", "/v1/messages", "anthropic"),
    Route("count_tokens", "/v1/messages/count_tokens", "anthropic"),
    Route("responses", "/v1/responses", "openai"),
    Route("embeddings", "/v1/embeddings", "openai"),
)
