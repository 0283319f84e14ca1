"""The inference endpoints the router serves, and the API style each one speaks."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.api.errors import ApiStyle


@dataclass(frozen=True, slots=True)
class Route:
    """One proxied endpoint: ``name`` is what ``parse_request`` expects, ``style`` the error format;
    ``answer_field`` is the top-level field every 2xx JSON answer carries, ``event_field`` the one
    every event of a streamed answer carries (server/answer_shape.py)."""

    name: str
    path: str
    style: ApiStyle
    answer_field: str
    event_field: str = "type"

    @property
    def sse_error_event(self) -> bool:
        """Whether a stream on this route reports errors as a named ``event: error`` (Anthropic and
        the Responses API) rather than as a bare ``data: {"error": ...}`` (chat and completions)."""
        return self.style == "anthropic" or self.name == "responses"


HTTP_ROUTES: tuple[Route, ...] = (
    Route("chat", "/v1/chat/completions", "openai", "choices", "choices"),
    Route("completions", "/v1/completions", "openai", "choices", "choices"),
    Route("messages", "/v1/messages", "anthropic", "content"),
    Route("count_tokens", "/v1/messages/count_tokens", "anthropic", "input_tokens"),
    Route("responses", "/v1/responses", "openai", "output"),
    Route("embeddings", "/v1/embeddings", "openai", "data"),
)
