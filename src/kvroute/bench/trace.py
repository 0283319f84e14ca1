"""Workloads as JSONL traces: one request per line, sessions grouped by their id.

A line is ``{"session_id": "...", "round": 0, "system": "...", "messages": [{"role": ..., "content":
...}, ...], "max_tokens": 256}``.  ``messages`` is the whole conversation as sent (a captured trace
looks like that), ``system``, ``round``, ``session_id`` and ``think_s`` (the client's pause
before sending, after the previous response) are optional: lines without a session id are
one-request sessions, and rounds default to the order of the lines.  Message contents must be
strings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from kvroute.bench.workloads import Message, PlannedRequest, SessionScript


class TraceError(ValueError):
    """A trace line that cannot be read, with its line number."""


def write_trace(path: Path, sessions: Iterable[SessionScript]) -> int:
    """Write every request of ``sessions`` to ``path``; returns the number of lines written."""
    count = 0
    with path.open("wb") as out:
        for script in sessions:
            for req in script.requests:
                line: dict[str, Any] = {
                    "session_id": req.session_id, "round": req.round, "system": req.system,
                    "messages": [m.as_dict() for m in req.messages], "max_tokens": req.max_tokens,
                    "think_s": req.think_s,
                }
                out.write(orjson.dumps(line) + b"\n")
                count += 1
    return count


def _load_line(raw: bytes, lineno: int) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"line {lineno}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected an object")
    sid = obj.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise TraceError(f"line {lineno}: 'session_id' must be a string")
    return obj


def _parse_request(obj: dict[str, Any], lineno: int, default_round: int) -> PlannedRequest:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TraceError(f"line {lineno}: 'messages' must be a non-empty list")
    parsed: list[Message] = []
    for i, msg in enumerate(messages):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)
                and isinstance(msg.get("content"), str)):
            raise TraceError(f"line {lineno}: messages[{i}] needs string 'role' and 'content'")
        parsed.append(Message(msg["role"], msg["content"]))
    system = obj.get("system", "")
    max_tokens = obj.get("max_tokens", 256)
    rnd = obj.get("round", default_round)
    if not isinstance(system, str):
        raise TraceError(f"line {lineno}: 'system' must be a string")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise TraceError(f"line {lineno}: 'max_tokens' must be a positive integer")
    if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
        raise TraceError(f"line {lineno}: 'round' must be a non-negative integer")
    think = obj.get("think_s", 0.0)
    if isinstance(think, bool) or not isinstance(think, int | float) or not 0 <= think < float("inf"):
        raise TraceError(f"line {lineno}: 'think_s' must be a non-negative number of seconds")
    return PlannedRequest(obj.get("session_id"), rnd, system, tuple(parsed), max_tokens, float(think))


def read_trace(path: Path) -> list[SessionScript]:
    """Sessions of a JSONL trace, in order of their first line, rounds sorted."""
    # Each slot is one session: a list of its requests; a session id maps to its slot.
    slots: list[list[PlannedRequest]] = []
    by_id: dict[str, list[PlannedRequest]] = {}
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            obj = _load_line(raw, lineno)
            sid = obj.get("session_id")
            slot = by_id.get(sid) if sid is not None else None
            if slot is None:
                slot = []
                slots.append(slot)
                if sid is not None:
                    by_id[sid] = slot
            slot.append(_parse_request(obj, lineno, len(slot)))
    return [SessionScript(reqs[0].session_id, tuple(sorted(reqs, key=lambda r: r.round))) for reqs in slots]


@dataclass(frozen=True, slots=True)
class TraceWorkload:
    """A finite workload read from a trace: session ``i`` is the trace's ``i``-th session."""

    scripts: tuple[SessionScript, ...]

    @classmethod
    def from_path(cls, path: Path) -> TraceWorkload:
        """Read ``path`` (see the module docstring for the format)."""
        scripts = tuple(read_trace(path))
        if not scripts:
            raise TraceError(f"{path}: the trace holds no requests")
        return cls(scripts)

    @property
    def size(self) -> int | None:
        """Number of sessions in the trace."""
        return len(self.scripts)

    def session(self, index: int) -> SessionScript:
        """Session ``index`` of the trace."""
        if index < 0:
            raise IndexError(index)
        return self.scripts[index]
