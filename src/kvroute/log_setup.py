"""How kvroute's processes log: text lines or JSON lines (``--log-format``), on standard error.

A JSON line has ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger`` and ``msg``; a
record that carries ``fields`` (the access log's, see server/access_log.py) adds them as keys,
and an exception adds ``exc`` (its traceback as one string), so one event stays one line.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

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


def setup_logging(level: str, log_format: str = "text", *, process: int | None = None) -> None:
    """Send every logger's records at ``level`` or above to standard error in ``log_format``
    ("text" or "json"); replaces handlers set before.  Raises ValueError naming a bad level or
    format (the commands turn it into a one-line error)."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process))
    elif log_format == "text":
        name = "%(name)s" if process is None else f"%(name)s[{process}]"
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {name}: %(message)s"))
    else:
        raise ValueError(f"log format must be text or json, got {log_format!r}")
    # Neither format names a record's process id, thread or process name: not looking them up
    # spares each record a getpid system call and two lookups (at INFO, a decision line is
    # logged per request).
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
