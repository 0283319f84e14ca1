"""How kvroute's processes log (log_setup.py): the lines, and what a record costs to make."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator

import orjson
import pytest

from kvroute.log_setup import setup_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """The root logger's handlers and level, and logging's record flags, put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    flags = logging.logProcesses, logging.logThreads, logging.logMultiprocessing
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.logProcesses, logging.logThreads, logging.logMultiprocessing = flags


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_records_skip_what_no_line_shows(restored_logging: None, log_format: str) -> None:
    # A decision line per request at INFO: its record looks up no process id (a getpid system
    # call), thread or process name, which neither format shows.
    setup_logging("info", log_format, process=2)
    records: list[logging.LogRecord] = []
    [handler] = logging.getLogger().handlers
    assert isinstance(handler, logging.StreamHandler)
    out = io.StringIO()
    handler.setStream(out)
    handler.addFilter(lambda record: records.append(record) or True)  # sees every record, drops none
    logging.getLogger("kvroute.decision").info("%s model=%s", "[AUTO] sticky", "m")
    [record] = records
    assert record.process is None and record.thread is None and record.processName is None
    line = out.getvalue().strip()
    if log_format == "json":
        doc = orjson.loads(line)
        assert doc["msg"] == "[AUTO] sticky model=m" and doc["process"] == 2 and doc["level"] == "INFO"
    else:
        assert line.endswith(" INFO kvroute.decision[2]: [AUTO] sticky model=m")
    assert str(os.getpid()) not in line
