"""How kvroute's processes log (log_setup.py): the lines, and what a record costs to make."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import threading
import time
from collections.abc import Iterator

import orjson
import pytest

from kvroute.log_setup import LineHandler, TextFormatter, setup_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """The root logger's handlers and level, and logging's record flags, put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    flags = logging.logProcesses, logging.logThreads, logging.logMultiprocessing
    srcfile = logging._srcfile
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.logProcesses, logging.logThreads, logging.logMultiprocessing = flags
    logging._srcfile = srcfile


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
    assert record.lineno == 0  # no walk up the caller's frames for its source line
    line = out.getvalue().strip()
    if log_format == "json":
        doc = orjson.loads(line)
        assert doc["msg"] == "[AUTO] sticky model=m" and doc["process"] == 2 and doc["level"] == "INFO"
    else:
        assert line.endswith(" INFO kvroute.decision[2]: [AUTO] sticky model=m")
    assert str(os.getpid()) not in line


class Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        if text:
            self.writes.append(text)
        return super().write(text)


def handler_on(stream: Writes) -> tuple[logging.Logger, LineHandler]:
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger(f"kvroute.test.{id(stream)}")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    return log, handler


async def test_lines_of_one_turn_of_the_loop_leave_in_one_write() -> None:
    stream = Writes()
    log, _ = handler_on(stream)
    for i in range(5):
        log.info("line %d", i)
    assert stream.writes == []  # kept for the end of this turn of the loop
    await asyncio.sleep(0)
    assert stream.writes == ["".join(f"line {i}\n" for i in range(5))]
    log.info("next")
    await asyncio.sleep(0)
    assert stream.writes[1:] == ["next\n"]


async def test_a_line_from_another_thread_follows_the_pending_ones() -> None:
    stream = Writes()
    log, _ = handler_on(stream)
    log.info("first")
    thread = threading.Thread(target=log.info, args=("from a thread",))
    thread.start()
    thread.join()
    assert stream.getvalue() == "first\nfrom a thread\n"  # written at once, in order
    await asyncio.sleep(0)
    assert stream.getvalue() == "first\nfrom a thread\n"  # nothing written twice


def test_without_a_loop_a_line_is_written_at_once_and_flush_writes_what_is_pending() -> None:
    stream = Writes()
    log, handler = handler_on(stream)
    log.info("now")
    assert stream.writes == ["now\n"]

    async def log_and_leave() -> None:
        log.info("kept")  # the loop closes before its turn ends

    loop = asyncio.new_event_loop()
    loop.run_until_complete(log_and_leave())
    loop.close()
    assert stream.getvalue() in ("now\n", "now\nkept\n")
    handler.flush()  # as logging.shutdown does at exit
    assert stream.getvalue() == "now\nkept\n"


def test_the_text_time_is_what_logging_writes_across_seconds() -> None:
    mine, logging_own = TextFormatter("%(asctime)s"), logging.Formatter("%(asctime)s")
    start = int(time.time())
    for created in (start + 0.0004, start + 0.9996, start + 1.25, start + 1.5, start + 3600.001):
        record = logging.makeLogRecord({"msg": "x", "created": created, "msecs": (created % 1) * 1000})
        assert mine.format(record) == logging_own.format(record)
