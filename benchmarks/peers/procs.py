"""Starting, waiting for and stopping the processes of one run (replicas, routers).

Each process writes its output to a log file of its own in the run directory; it is stopped by its
own pid (SIGTERM, then SIGKILL after a grace period), never by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import aiohttp
import orjson

from peers.routers import Launch

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time (user + system) used so far by ``pids`` and all their descendants, from /proc;
    processes that have gone count nothing."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
        fields = text[text.rindex(")") + 2:].split()
        pid, ppid = int(stat.parent.name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        times[pid] = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += times.get(pid, 0.0)
        todo.extend(children.get(pid, ()))
    return total


class StartError(RuntimeError):
    """A process did not come up; the message ends with the tail of its log."""


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


class Proc:
    """One child process with its log file."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log_path: Path,
                 log_file: IO[bytes]) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path
        self._log_file = log_file

    @classmethod
    async def start(cls, name: str, argv: Sequence[str], log_dir: Path, *,
                    env: Mapping[str, str] | None = None, stdout_pipe: bool = False) -> Proc:
        """Start ``argv`` with ``env`` added to this process's environment."""
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        log_file = log_path.open("wb")
        full_env = {**os.environ, **(env or {})}
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if stdout_pipe else log_file, stderr=log_file, env=full_env)
        return cls(name, process, log_path, log_file)

    def check_alive(self) -> None:
        """Raise StartError if the process has exited."""
        if self.process.returncode is not None:
            raise StartError(f"{self.name} exited with {self.process.returncode}:\n{_tail(self.log_path)}")

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``grace_s``."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        self._log_file.close()


async def start_sim(log_dir: Path, preset: str, replicas: int, speed: float,
                    sim_opts: Sequence[str] = (), timeout_s: float = 30.0) -> tuple[Proc, list[str]]:
    """The simulated replicas with their placement log (``peers.simfleet``) and their URLs."""
    bench_dir = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": bench_dir + (os.pathsep + path if path else "")}
    argv = [sys.executable, "-m", "peers.simfleet", "--preset", preset, "--replicas", str(replicas),
            "--speed", repr(speed)]
    for opt in sim_opts:
        argv += ["--sim-opt", opt]
    proc = await Proc.start("sim", argv, log_dir, env=env, stdout_pipe=True)
    assert proc.process.stdout is not None
    try:
        line = await asyncio.wait_for(proc.process.stdout.readline(), timeout_s)
        urls = [str(u) for u in orjson.loads(line)["urls"]]
    except (TimeoutError, ValueError, KeyError) as exc:
        await proc.stop()
        raise StartError(f"simulated replicas did not start ({exc!r}):\n{_tail(proc.log_path)}") from None
    return proc, urls


async def wait_serving(launch: Launch, proc: Proc, model: str, timeout_s: float = 60.0) -> None:
    """Wait until the router answers a one-token chat request with 200 (every router is judged
    ready the same way, whatever its own health endpoint means)."""
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "ready?"}],
                         "max_tokens": 1})
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while time.monotonic() < deadline:
            proc.check_alive()
            try:
                async with http.post(launch.url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"}) as resp:
                    if resp.status == 200:
                        await resp.read()
                        return
                    last = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = repr(exc)
            await asyncio.sleep(0.2)
    raise StartError(f"{proc.name} not serving after {timeout_s:.0f} s ({last}):\n{_tail(proc.log_path)}")


async def fetch_json(url: str) -> object:
    """GET ``url`` and decode its JSON body."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http, \
            http.get(url) as resp:
        resp.raise_for_status()
        return orjson.loads(await resp.read())
