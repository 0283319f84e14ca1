"""``kvroute serve --processes N``: N router processes on one address, sharing routing state.

One Python process routes on one core.  With ``processes`` > 1, ``kvroute serve`` becomes a
supervisor that starts N router processes, all listening on the same host:port with
``SO_REUSEPORT`` (the kernel spreads new connections over them), and sharing the routing state
through Redis: ``redis_url`` if given, otherwise a private ``redis-server`` on a Unix socket that
lives as long as the router (``PrivateRedis``).  The processes reach each other through private
sockets in a directory the supervisor creates (see server/siblings.py) so that ``/metrics``, the
dashboard and the admin API describe and act on the whole router.

The supervisor holds the port from the start (a bound socket that never listens, so it receives
no connections): a busy port fails at once with a clear message, port 0 becomes one real port for
every process, and a restarted process finds its port still reserved for it.

Shutdown: SIGINT or SIGTERM is passed on to every process as SIGTERM; each finishes its in-flight
requests (``shutdown_timeout_s``) as a single ``kvroute serve`` does.  A second signal kills them.
A process that dies unexpectedly is restarted (at most ``MAX_RESTARTS`` times a minute, logged) while
the others keep serving; the supervisor exits non-zero when a process ends with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

from kvroute.event_loop import run_event_loop
from kvroute.log_setup import setup_logging
from kvroute.router_settings import Settings
from kvroute.startup import host_port, listen_error
from kvroute.sync.private_redis import PrivateRedis, exit_with_parent
from kvroute.sync.redis_bus import redact_url

log = logging.getLogger("kvroute.server")

MAX_RESTARTS = 5            # per process, within RESTART_WINDOW_S
RESTART_WINDOW_S = 60.0
_RESTART_DELAY_S = 1.0      # before a second restart within the window (a crash loop must not spin)
_POLL_S = 0.1


class SupervisorError(RuntimeError):
    """The router could not start; the message says why."""


@dataclass(slots=True)
class _Process:
    """One router process slot: the running process and its restart history."""

    index: int
    process: subprocess.Popen[bytes] | None = None
    ready: bool = False
    restarts: deque[float] = field(default_factory=deque)
    restart_at: float | None = None
    failed: bool = False  # exited with an error and not restarted


def _reserve(host: str, port: int) -> socket.socket:
    """Bind (never listen on) ``host:port`` with SO_REUSEPORT: the router processes join it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SupervisorError(listen_error(host_port(host, port), exc)) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise SupervisorError(listen_error(host_port(host, port), exc)) from None
    return sock


class Supervisor:
    """Runs ``settings.processes`` router processes until a signal; ``run()`` returns the exit code."""

    def __init__(self, settings: Settings, *, log_level: str = "info") -> None:
        self.settings = settings
        self.log_level = log_level
        self._slots = [_Process(i) for i in range(settings.processes)]
        self._signals = 0
        self._run_dir: Path | None = None
        self._redis: PrivateRedis | None = None
        self._reservation: socket.socket | None = None
        self._spec = b""
        self.url = ""

    def run(self) -> int:
        """Start everything, supervise until SIGINT/SIGTERM, stop everything."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self._prepare()
            except SupervisorError as exc:
                log.error("%s", exc)
                return 1
            return self._supervise()
        finally:
            self._stop_all()
            self._cleanup()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # --- start ---------------------------------------------------------------------------------

    def _prepare(self) -> None:
        s = self.settings
        self._reservation = _reserve(s.host, s.port)
        port = int(self._reservation.getsockname()[1])
        self._run_dir = Path(tempfile.mkdtemp(prefix="kvroute-processes-"))  # mode 0700
        redis_url = s.redis_url
        if redis_url is None:
            try:
                self._redis = PrivateRedis(self._run_dir)
                self._redis.start()
            except (FileNotFoundError, RuntimeError) as exc:
                raise SupervisorError(f"cannot start a private Redis for the router processes: {exc}"
                                      ) from None
            redis_url = self._redis.url
            if s.sync_key() is None:
                # Only this router's processes write to its private Redis: signed all the same, so
                # that none of them warns about an unsigned bus.
                s = s.replace(sync_secret=secrets.token_hex(32))
        child = s.replace(port=port, redis_url=redis_url, processes=1)
        # Given on each process's stdin: the settings hold the admin token, which must not be left
        # in a file (a killed supervisor cannot clean up) nor on a command line (anyone can read it).
        self._spec = orjson.dumps({"settings": asdict(child), "processes": s.processes,
                                   "log_level": self.log_level, "supervisor": os.getpid()})
        shown = f"[{s.host}]" if ":" in s.host else s.host
        self.url = f"http://{shown}:{port}"
        log.info("starting %d router processes on %s, sharing state through %s", s.processes, self.url,
                 "a private Redis" if self._redis is not None else redact_url(redis_url))
        for slot in self._slots:
            self._spawn(slot, restarted=False)

    def _spawn(self, slot: _Process, *, restarted: bool) -> None:
        assert self._run_dir is not None
        argv = [sys.executable, "-m", "kvroute.server.processes", str(self._run_dir), str(slot.index)]
        if restarted:
            argv.append("--restarted")
        # Its own process group: a Ctrl-C reaches the supervisor only, which passes it on once.
        slot.process = subprocess.Popen(argv, stdin=subprocess.PIPE, process_group=0)
        assert slot.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: seen by the next poll
            slot.process.stdin.write(self._spec)
        slot.process.stdin.close()
        slot.ready = False
        slot.restart_at = None

    # --- supervise -----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        self._forward(signal.SIGTERM if self._signals == 1 else signal.SIGKILL)

    def _forward(self, sig: int) -> None:
        # os.kill rather than Popen.send_signal: this also runs inside a signal handler, possibly
        # while the main loop is in Popen.poll/wait.
        for slot in self._slots:
            if slot.process is not None and slot.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.process.pid, sig)

    def _supervise(self) -> int:
        assert self._run_dir is not None
        announced = False
        while not self._signals:
            now = time.monotonic()
            for slot in self._slots:
                if slot.process is None:
                    if slot.restart_at is not None and now >= slot.restart_at:
                        self._spawn(slot, restarted=True)
                    continue
                if not slot.ready:
                    slot.ready = (self._run_dir / f"proc-{slot.index}.sock").exists()
                code = slot.process.poll()
                if code is not None:
                    if not announced:
                        log.error("router process %d exited with %s before the router was ready", slot.index,
                                  _describe(code))
                        return 1
                    self._exited(slot, code, now)
            if not announced and all(slot.ready for slot in self._slots):
                announced = True
                log.info("kvroute listening on %s: %d router processes, %d workers, policy %s", self.url,
                         len(self._slots), len(self.settings.workers), self.settings.policy)
            if all(slot.failed for slot in self._slots):
                log.error("every router process failed; stopping")
                return 1
            time.sleep(_POLL_S)
        log.info("shutting down: the router processes finish their in-flight requests (up to %.0f s)",
                 self.settings.shutdown_timeout_s)
        self._forward(signal.SIGTERM)  # again: a process started while the signal came missed it
        codes = self._wait_all(self.settings.shutdown_timeout_s + 10.0)
        # -SIGTERM: a process still starting, before it could handle the signal; nothing was in flight.
        bad = {i: c for i, c in codes.items() if c not in (0, -signal.SIGTERM)}
        for i, code in bad.items():
            log.error("router process %d ended with %s", i, _describe(code))
        return 1 if bad or any(slot.failed for slot in self._slots) else 0

    def _exited(self, slot: _Process, code: int, now: float) -> None:
        """A process died while the router runs: restart it, within bounds."""
        assert self._run_dir is not None and slot.process is not None
        pid = slot.process.pid
        slot.process = None
        for path in (f"proc-{slot.index}.sock", f".proc-{slot.index}.sock"):
            with contextlib.suppress(FileNotFoundError):
                (self._run_dir / path).unlink()
        while slot.restarts and now - slot.restarts[0] > RESTART_WINDOW_S:
            slot.restarts.popleft()
        if len(slot.restarts) >= MAX_RESTARTS:
            slot.failed = True
            log.error("router process %d (pid %d) exited with %s; not restarting it: %d restarts in the "
                      "last %.0f s. The other processes keep serving.", slot.index, pid, _describe(code),
                      len(slot.restarts), RESTART_WINDOW_S)
            return
        delay = _RESTART_DELAY_S if slot.restarts else 0.0
        slot.restarts.append(now)
        slot.restart_at = now + delay
        log.warning("router process %d (pid %d) exited with %s; restarting it (restart %d of at most %d "
                    "a minute)", slot.index, pid, _describe(code), len(slot.restarts), MAX_RESTARTS)

    # --- stop ----------------------------------------------------------------------------------

    def _wait_all(self, timeout_s: float) -> dict[int, int]:
        """Wait for every process to exit; kill those still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        codes: dict[int, int] = {}
        for slot in self._slots:
            if slot.process is None:
                continue
            try:
                codes[slot.index] = slot.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("router process %d did not stop in time; killing it", slot.index)
                slot.process.kill()
                codes[slot.index] = slot.process.wait()
            slot.process = None
        return codes

    def _stop_all(self) -> None:
        """Whatever is still running at exit (after an error): SIGTERM, a short wait, SIGKILL."""
        running = [s for s in self._slots if s.process is not None and s.process.poll() is None]
        for slot in running:
            assert slot.process is not None
            with contextlib.suppress(ProcessLookupError):
                slot.process.terminate()
        if running:
            self._wait_all(self.settings.shutdown_timeout_s + 10.0)

    def _cleanup(self) -> None:
        if self._redis is not None:
            self._redis.close()
        if self._reservation is not None:
            self._reservation.close()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


# --- a router process --------------------------------------------------------------------------

def child_main(argv: list[str]) -> None:
    """Entry point of one router process: ``RUN_DIR INDEX [--restarted]``, its settings on stdin."""
    run_dir, index, restarted = Path(argv[0]), int(argv[1]), "--restarted" in argv[2:]
    exit_with_parent()
    spec: dict[str, Any] = orjson.loads(sys.stdin.buffer.read())
    if os.getppid() != spec["supervisor"]:  # it died before we could ask to follow it
        sys.exit(1)
    settings = Settings.from_dict(spec["settings"])
    setup_logging(str(spec["log_level"]), settings.log_format, process=index)
    if run_event_loop(_serve_child(settings, run_dir, index, int(spec["processes"]), restarted)):
        from kvroute.server.app import CUT_EXIT_CODE

        sys.exit(CUT_EXIT_CODE)  # the shutdown timeout cut requests (logged by the router)


async def _serve_child(settings: Settings, run_dir: Path, index: int, processes: int,
                       restarted: bool) -> int:
    from kvroute.server.app import freeze_startup_heap, start_router
    from kvroute.server.dashboard import setup_dashboard
    from kvroute.server.siblings import Siblings, apply_fleet, copy_drains, fleet_specs

    siblings = Siblings(run_dir, index, processes,
                        timeout_s=settings.probe_timeout_s + settings.upstream_connect_timeout_s + 5.0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # A restarted process takes its siblings' fleet (admin calls made since the start included).
    fleet = await siblings.fleet() if restarted else None
    if restarted and fleet is None:
        log.warning("no other router process answered: serving the configured workers")
    if fleet is not None:
        settings = settings.replace(workers=fleet_specs(fleet))
    running = await start_router(settings, host=settings.host, port=settings.port,
                                 setup=(setup_dashboard, siblings.mount), reuse_port=True,
                                 canary_share=1.0 / processes)
    if fleet is not None:
        # Before anything is awaited: no request can have been routed since the port opened.
        copy_drains(running.router, fleet)
    await siblings.start(running.router)
    siblings.publish()
    if fleet is not None and (latest := await siblings.fleet()) is not None:
        await apply_fleet(running.router, latest)  # admin calls made while this process started
    freeze_startup_heap()
    log.debug("router process %d (pid %d) serving", index, os.getpid())
    await stop.wait()
    siblings.unpublish()
    report = await running.close()
    await siblings.close()
    return report.cut


if __name__ == "__main__":
    child_main(sys.argv[1:])
