"""Whether a worker's 2xx answer is an answer of the API at all, checked cheaply enough for every
event the relay passes on.

A replica can answer 200 with bytes that are not the API's: JSON that does not parse or lacks the
answer's field, an event stream that is not SSE, an event larger than any engine sends, garbage in
the middle of a stream.  Relayed, such an answer breaks the client's SDK while the router counts a
success.  The checks here let the proxy answer 502 (or end the stream with an error event) and
count the replica's failure instead.

Events are checked for their framing only: every line a ``data:``, ``event:``, ``id:``, ``retry:``
or comment line, every ``data:`` line one JSON object (its first and last bytes) or ``[DONE]``.
The first event of a stream, and a plain body, are parsed: once per answer, and a plain body's
parse also gives the proxy its token usage.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kvroute.server.routes import Route

# Lines of whole events (CRLF made LF first): data lines carrying one JSON object (or OpenAI's
# [DONE]), the other SSE fields, comments and the blank lines between events.  "." rather than
# "[^\r\n]": the regular expression engine runs it several times faster.
_EVENT_LINES = re.compile(rb"(?:(?:data: ?(?:\{.*\}[ \t]*|\[DONE\])|(?:event|id|retry)?:.*)?\n)*")
_DATA_LINE = re.compile(rb"^data: ?(.*?)\r?$", re.M)
_BLANK = re.compile(rb"\r?\n\r?\n")


def sse_problem(events: bytes, max_event_bytes: int) -> str | None:
    """Why ``events`` (whole SSE events, ending with a blank line) are not what an engine sends, or
    None.  The common cases, one OpenAI event (``data: {...}``) or one Anthropic event (``event:
    NAME`` then ``data: {...}``), cost a few bytes comparisons; anything else a regular expression."""
    if events.endswith(b"}\n\n"):
        end = len(events) - 2
        line = events.find(b"\n")
        if events.startswith(b"data: {"):
            single = line == end
        else:
            single = (events.startswith(b"event: ") and events.startswith(b"data: {", line + 1)
                      and events.find(b"\n", line + 1) == end)
        if single:
            if len(events) > max_event_bytes:
                return f"an event of {len(events)} bytes (more than max_event_bytes = {max_event_bytes})"
            return None
    if _EVENT_LINES.fullmatch(events.replace(b"\r\n", b"\n") if b"\r" in events else events) is None:
        return "not an event stream (a line that is not an SSE field, or data that is not a JSON object)"
    if len(events) > max_event_bytes:
        largest = max(len(e) for e in _BLANK.split(events))
        if largest > max_event_bytes:
            return f"an event of {largest} bytes (more than max_event_bytes = {max_event_bytes})"
    return None


def first_event_problem(route: Route, events: bytes) -> str | None:
    """Why a stream's first whole event(s) are not the start of ``route``'s stream, or None: the
    first data must be a JSON object with the field the route's events carry (or an engine's own
    ``error``).  Events without data (comments, keep-alives) say nothing either way."""
    match = _DATA_LINE.search(events)
    if match is None:
        return None
    payload = match.group(1)
    if payload == b"[DONE]":
        return None  # an empty stream: odd, but the API's own framing
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        return f"the first event's data is not JSON ({exc})"
    if not isinstance(doc, dict) or (route.event_field not in doc and "error" not in doc):
        return f"the first event is not a {route.name} event (no {route.event_field!r})"
    return None


def body_answer(route: Route, body: bytes) -> tuple[Any, str | None]:
    """A plain 2xx body parsed, and why it is not ``route``'s answer (None if it is one)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return None, f"the body is not JSON ({exc})"
    value = doc.get(route.answer_field) if isinstance(doc, dict) else None
    if not isinstance(value, list | int) or isinstance(value, bool):
        return doc, f"the body is not a {route.name} answer (no {route.answer_field!r})"
    return doc, None


def body_start_problem(route: Route, start: bytes) -> str | None:
    """For a body too large to hold: why its first bytes cannot start ``route``'s answer, or None."""
    if start.lstrip()[:1] != b"{":
        return f"the body is not a JSON object, so not a {route.name} answer"
    return None
