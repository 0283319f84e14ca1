"""A private ``redis-server`` for the processes of one ``kvroute serve --processes N``.

It listens on a Unix socket only (``port 0``: no TCP at all), inside a directory only the router's
user can enter, so no other user of the host can read or rewrite the routing state (an open Redis
on loopback would also let any local user write files as this user through ``CONFIG SET dir``).
The configuration goes in a file in that directory, not on the command line, which every user can
read.  Nothing is persisted: the state lives as long as the router does.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def exit_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere), so that a
    supervisor killed with SIGKILL leaves nothing running behind it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


class PrivateRedis:
    """One ``redis-server`` on ``<directory>/redis.sock`` (the directory should be mode 0700)."""

    def __init__(self, directory: Path, *, executable: str = "redis-server") -> None:
        path = shutil.which(executable)
        if path is None:
            raise FileNotFoundError(f"{executable} not found on PATH")
        self.executable = path
        self.directory = directory
        self.socket_path = directory / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The ``unix://`` URL the router processes connect to."""
        return f"unix://{self.socket_path}?db=0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers; raises RuntimeError if it does not.  It runs
        in its own process group (a Ctrl-C meant for the router does not stop it under the router
        processes' feet) and is killed if this process dies."""
        config = self.directory / "redis.conf"
        config.write_text(
            "port 0\n"
            f'unixsocket "{self.socket_path}"\n'
            "unixsocketperm 700\n"
            'save ""\n'
            "appendonly no\n"
            f'dir "{self.directory}"\n'
            "daemonize no\n"
            "loglevel warning\n"
            'logfile "redis.log"\n'
        )
        self.process = subprocess.Popen([self.executable, str(config)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=exit_with_parent, process_group=0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if self._pong():
                return
            time.sleep(0.02)
        log_tail = ""
        with contextlib.suppress(OSError):
            log_tail = (self.directory / "redis.log").read_text(errors="replace")[-500:]
        self.close()
        raise RuntimeError(f"redis-server did not start on {self.socket_path}: {log_tail.strip()}")

    def _pong(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect(str(self.socket_path))
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
