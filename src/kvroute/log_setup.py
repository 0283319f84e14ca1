"""How kvroute's processes log: text lines or JSON lines (``--log-format``), on standard error.

Lines logged on an event loop's thread leave in one write per turn of the loop (see
:class:`LineHandler`).  A JSON line has ``ts`` (UTC, ISO 8601 with milliseconds), ``level``,
``logger`` and ``msg``; a record that carries ``fields`` (the access log's, see
server/access_log.py) adds them as keys, and an exception adds ``exc`` (its traceback as one
string), so one event stays one line.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from asyncio import events
from collections.abc import Mapping
from typing import Any, TextIO

import orjson

LEVELS = ("debug", "info", "warning", "error")


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``process``: the router process index, when there are several."""

    def __init__(self, process: int | None = None) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        """The record as one JSON line (no newline in it: tracebacks are escaped)."""
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        doc: dict[str, Any] = {"ts": f"{seconds}.{int(record.msecs):03d}Z", "level": record.levelname,
                               "logger": record.name, "msg": record.getMessage()}
        if self._process is not None:
            doc["process"] = self._process
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(doc, default=str).decode()


class LineHandler(logging.StreamHandler[TextIO]):
    """Writes records to a stream, those made on a running event loop's thread once per turn of
    the loop: at INFO a decision line is logged per request, and a write system call per line was
    the largest part of a record's cost.  Records from other threads, or with no loop running,
    are written at once, after what is pending, so the order of the lines is the order of the
    records.  ``flush`` (logging's shutdown calls it) writes what is pending."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._loop_thread: int | None = None  # the thread whose loop will write what is pending

    def emit(self, record: logging.LogRecord) -> None:
        """Format ``record``; keep its line for the loop's turn, or write it now."""
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        loop = events._get_running_loop()
        if loop is not None and not loop.is_closed():
            if not self._pending:
                loop.call_soon(self.flush)
                self._loop_thread = threading.get_ident()
            if self._loop_thread == threading.get_ident():
                self._pending.append(line)
                return
        self._write(line)

    def _write(self, line: str) -> None:
        try:
            stream = self.stream
            if self._pending:
                stream.write("".join(self._pending))
                self._pending.clear()
            stream.write(line)
            stream.flush()
        except Exception:
            self._pending.clear()
            self.handleError(logging.makeLogRecord({"msg": line.rstrip("\n")}))

    def flush(self) -> None:
        """Write the lines kept for the loop's turn, then flush the stream."""
        self.acquire()
        try:
            if self._pending:
                self._write("")
            else:
                super().flush()
        finally:
            self.release()


class TextFormatter(logging.Formatter):
    """logging's text lines with their time as ``%(asctime)s`` writes it by default, the
    second's part formatted once a second rather than once a record."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._second_text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """``2026-12-03 08:09:46,123``: local time, milliseconds after a comma."""
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime(self.default_time_format, self.converter(second))
            self._second = second
        return f"{self._second_text},{int(record.msecs):03d}"


def setup_logging(level: str, log_format: str = "text", *, process: int | None = None) -> None:
    """Send every logger's records at ``level`` or above to standard error in ``log_format``
    ("text" or "json"); replaces handlers set before.  Raises ValueError naming a bad level or
    format (the commands turn it into a one-line error)."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = LineHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process))
    elif log_format == "text":
        name = "%(name)s" if process is None else f"%(name)s[{process}]"
        handler.setFormatter(TextFormatter(f"%(asctime)s %(levelname)s {name}: %(message)s"))
    else:
        raise ValueError(f"log format must be text or json, got {log_format!r}")
    # Neither format names a record's process id, thread or process name: not looking them up
    # spares each record a getpid system call and two lookups (at INFO, a decision line is
    # logged per request).
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    # Nor a record's source file, function and line: without a source file logging does not walk
    # the caller's frames for them (the switch logging's own source names for it).
    logging._srcfile = None
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
