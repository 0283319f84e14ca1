"""Requests to an engine or a router that never raise: a transport failure or timeout is a ``Reply``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson

# Cap on any body we read: a /metrics page is tens of kilobytes, a reply a few.
_MAX_BODY = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Target:
    """One base URL and how to talk to it."""

    base_url: str
    api_key: str | None = None
    timeout_s: float = 10.0

    def url(self, path: str) -> str:
        """``base_url`` joined with ``path`` (which starts with ``/``)."""
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        """Headers for every request (the API key, if any)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class Reply:
    """One response: status (None if no response came), body or the transport error."""

    status: int | None
    body: bytes = b""
    error: str | None = None
    seconds: float = 0.0

    def json(self) -> object | None:
        """The body as JSON, or None if it is not JSON."""
        try:
            value: object = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None
        return value


async def request(session: aiohttp.ClientSession, method: str, url: str, *, timeout_s: float,
                  headers: Mapping[str, str] | None = None, body: object | None = None) -> Reply:
    """Send one request; transport failures and timeouts come back as ``Reply.error``."""
    started = time.perf_counter()
    data = orjson.dumps(body) if body is not None else None
    send_headers = dict(headers or {})
    if data is not None:
        send_headers["Content-Type"] = "application/json"
    try:
        async with session.request(method, url, data=data, headers=send_headers,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            # StreamReader.read(n) returns what has arrived so far, not n bytes: a /metrics
            # page cut at a chunk boundary then read as malformed (found by the real-vLLM test).
            parts: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_any():
                parts.append(chunk)
                size += len(chunk)
                if size >= _MAX_BODY:
                    break
            payload = b"".join(parts)[:_MAX_BODY]
            return Reply(resp.status, payload, None, time.perf_counter() - started)
    except TimeoutError:
        return Reply(None, b"", f"no answer within {timeout_s:g} s", time.perf_counter() - started)
    except aiohttp.ClientError as exc:
        return Reply(None, b"", f"{type(exc).__name__}: {exc}", time.perf_counter() - started)


async def served_model(session: aiohttp.ClientSession, target: Target) -> str | None:
    """The first model id ``/v1/models`` lists, or None."""
    reply = await request(session, "GET", target.url("/v1/models"), timeout_s=target.timeout_s,
                          headers=target.headers())
    body = reply.json() if reply.status == 200 else None
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return str(data[0]["id"])
    return None
