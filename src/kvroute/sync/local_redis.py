"""A throwaway ``redis-server`` on loopback, for tests, benchmarks and demos of several instances.

Nothing is persisted (``--save "" --appendonly no``), so a kill -9 and restart on the same port
gives an empty server, like a Redis restarted without persistence in production.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from types import TracebackType


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process may still take it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """One ``redis-server`` process on 127.0.0.1 (``port`` 0: a free port, kept across restarts)."""

    def __init__(self, *, port: int = 0, password: str | None = None, executable: str = "redis-server",
                 extra_args: tuple[str, ...] = ()) -> None:
        path = shutil.which(executable)
        if path is None:
            raise FileNotFoundError(f"{executable} not found on PATH (apt-get install redis-server)")
        self.executable = path
        self.port = port
        self.password = password
        self.extra_args = extra_args
        self._dir = tempfile.TemporaryDirectory(prefix="kvroute-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://`` URL of the server, with the password when one is set."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers (on a fresh free port if none was chosen)."""
        for _ in range(5):
            port = self.port or free_port()
            args = [self.executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
                    "--loglevel", "warning", "--logfile", "redis.log", *self.extra_args]
            if self.password:
                args += ["--requirepass", self.password]
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # A caller that never closes us (a crashed test, an interrupted script) must not leave
            # the server running: kill it when this object is collected or the interpreter exits.
            weakref.finalize(self, _kill, self.process)
            if self._wait_ready(port, timeout_s):
                self.port = port
                return
            self.kill()
            if self.port:  # a chosen port that will not bind: retrying the same one is pointless
                break
        raise RuntimeError(f"redis-server did not start on port {self.port or 'any'}")

    def _wait_ready(self, port: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                # NOAUTH also means it is up: it answers, it wants a password.
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is flushed, clients see their sockets die)."""
        if self.process is not None:
            _kill(self.process)
        self.process = None

    def close(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)
