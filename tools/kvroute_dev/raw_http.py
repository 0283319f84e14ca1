"""Raw-socket HTTP/1.1 helpers for the listening side's tests and benchmarks/chaos.py: send exact
bytes, parse whatever comes back, and mutate requests for fuzzing."""

from __future__ import annotations

import asyncio
import random
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools


@dataclass
class Answer:
    """One response read off a connection; ``complete``: its framing ended properly."""

    status: int
    headers: dict[bytes, bytes]
    body: bytes
    complete: bool = True


@dataclass
class Conversation:
    """Responses parsed off one connection, and whether the router closed it."""

    answers: list[Answer] = field(default_factory=list)
    closed: bool = False
    reset: bool = False
    interim: int = 0
    _headers: dict[bytes, bytes] = field(default_factory=dict)
    _body: list[bytes] = field(default_factory=list)
    _open: bool = False

    def __post_init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._headers, self._body, self._open = {}, [], True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._open = False
        status = self.parser.get_status_code()
        if status < 200:
            self.interim += 1  # 100 Continue: not an answer
            return
        self.answers.append(Answer(status, self._headers, b"".join(self._body)))

    def feed(self, data: bytes) -> None:
        """Parse more bytes from the router."""
        self.parser.feed_data(data)

    def eof(self) -> None:
        """The router closed the connection: a response cut short is kept, marked incomplete."""
        self.closed = True
        if self._open:
            self.answers.append(Answer(self.parser.get_status_code(), self._headers,
                                       b"".join(self._body), complete=False))
            self._open = False

    @property
    def statuses(self) -> list[int]:
        """The status of every response, in order."""
        return [a.status for a in self.answers]


async def connect(url: str, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection to ``url``'s host and port."""
    parts = urlsplit(url)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    return await asyncio.open_connection(sock=sock, limit=1 << 16)


async def read(reader: asyncio.StreamReader, conv: Conversation | None = None, *, count: int | None = None,
               timeout: float = 10.0) -> Conversation:
    """Read until ``count`` responses arrived, or (``count`` None) until the router closes; a
    bounded wait (the router must not hang)."""
    conv = conv or Conversation()
    async with asyncio.timeout(timeout):
        while count is None or len(conv.answers) < count:
            try:
                data = await reader.read(65536)
            except ConnectionError:
                conv.reset = True
                data = b""
            if not data:
                conv.eof()
                break
            try:
                conv.feed(data)
            except httptools.HttpParserError:  # not HTTP: kept as an answer cut short, status 0
                conv.eof()
                conv.answers.append(Answer(0, {}, b"", complete=False))
                break
    return conv


async def exchange(url: str, data: bytes, *, count: int | None = None, timeout: float = 10.0) -> Conversation:
    """Send ``data`` on a new connection and read the answers (see ``read``)."""
    reader, writer = await connect(url)
    try:
        writer.write(data)
        return await read(reader, count=count, timeout=timeout)
    finally:
        writer.close()


def post(path: bytes, body: bytes, extra: bytes = b"", *, close: bool = False) -> bytes:
    """A complete POST request with a JSON body."""
    return (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + extra
            + (b"connection: close\r\n" if close else b"") + b"content-length: %d\r\n\r\n" % len(body) + body)


HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


def mutate(rng: random.Random, data: bytes, tokens: list[bytes]) -> bytes:
    """A few random edits: flips, insertions of protocol ``tokens``, deletions, duplications, cuts."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(i, len(out) - 1)] = rng.randrange(256)
        elif op == 1:
            out[i:i] = rng.choice(tokens)
        elif op == 2:
            del out[i:i + rng.randint(1, 20)]
        elif op == 3:
            out[i:i] = out[i:i + rng.randint(1, 40)]
        elif op == 4:
            del out[i:]
        else:
            out[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(out)
