"""The routers compared, and the loopback-only command line that starts each one.

Every router gets the same requests.  Each request carries its session id in the three forms the
routers understand — kvroute reads ``X-Claude-Code-Session-Id`` (the agent workload's own header),
vllm-router's ``consistent_hash`` and ``sticky_least_loaded`` read ``X-Session-ID``, sglang-router's
``manual`` policy reads ``x-smg-routing-key`` — and every router ignores the forms it does not
know, so no router is denied the key and no request differs between routers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

KVROUTE = "kvroute"
VLLM_ROUTER = "vllm-router"
SGLANG_ROUTER = "sglang-router"
FAMILIES = (KVROUTE, VLLM_ROUTER, SGLANG_ROUTER)

# The peer versions the comparison pins (the newest on PyPI when it was written).
PEER_VERSIONS: Mapping[str, str] = {VLLM_ROUTER: "0.1.17", SGLANG_ROUTER: "0.3.2"}

# The session id under every name a router keys on (see the module docstring).
SESSION_HEADERS: tuple[str, ...] = ("X-Claude-Code-Session-Id", "X-Session-ID", "x-smg-routing-key")

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """One router configuration of the comparison: a family, a policy, and for kvroute the number
    of router processes (several share routing state through Redis)."""

    family: str
    policy: str
    processes: int = 1

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown router family {self.family!r}; expected one of {', '.join(FAMILIES)}")
        if self.processes < 1 or (self.processes > 1 and self.family != KVROUTE):
            raise ValueError("only kvroute runs as several processes")

    @property
    def label(self) -> str:
        """``family policy`` (``×N`` for several kvroute processes)."""
        suffix = f" ×{self.processes}" if self.processes > 1 else ""
        return f"{self.family} {self.policy}{suffix}"

    @property
    def cache_aware(self) -> bool:
        """Whether the policy looks at the prompt to find cached prefixes."""
        return (self.family == KVROUTE and self.policy in ("auto", "prefix")) or self.policy == "cache_aware"


# kvroute's default policy first: every ratio is taken against it.
DEFAULT_ROUTERS: tuple[RouterSpec, ...] = (
    RouterSpec(KVROUTE, "auto"),
    RouterSpec(VLLM_ROUTER, "cache_aware"),
    RouterSpec(VLLM_ROUTER, "consistent_hash"),
    RouterSpec(VLLM_ROUTER, "power_of_two"),
    RouterSpec(VLLM_ROUTER, "round_robin"),
    RouterSpec(VLLM_ROUTER, "sticky_least_loaded"),
    RouterSpec(SGLANG_ROUTER, "cache_aware"),
    RouterSpec(SGLANG_ROUTER, "power_of_two"),
    RouterSpec(SGLANG_ROUTER, "round_robin"),
    RouterSpec(SGLANG_ROUTER, "manual"),
)


def parse_router(text: str) -> RouterSpec:
    """``family:policy`` or ``family:policy:N`` (N kvroute processes), e.g. ``kvroute:auto:2``."""
    parts = text.strip().split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"expected FAMILY:POLICY[:PROCESSES], got {text!r}")
    processes = int(parts[2]) if len(parts) == 3 else 1
    return RouterSpec(parts[0], parts[1], processes)


@dataclass(frozen=True, slots=True)
class Launch:
    """One process to start: its argument vector, environment additions, and where it answers."""

    argv: tuple[str, ...]
    url: str
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ports:
    """Ports one router process may bind: the API, and the Prometheus listener a peer always opens
    (its default, 29000, would collide between runs and with anything else on the machine)."""

    api: int
    metrics: int


def peer_launch(spec: RouterSpec, venv: Path, workers: Sequence[str], ports: Ports, *,
                closed_port: int) -> Launch:
    """The command line of a vllm-router or sglang-router process listening on loopback only.

    sglang-router binds 0.0.0.0 for both its API and its metrics unless told otherwise, and looks
    for a tokenizer on the Hugging Face hub at start: ``HF_ENDPOINT`` points at ``closed_port`` on
    loopback, where nothing listens, so the attempt fails at once instead of leaving the machine.
    Both peers log at warning level, like kvroute, so that no router pays for a line per request.
    """
    if not workers:
        raise ValueError("no workers")
    common = ("--host", LOOPBACK, "--port", str(ports.api),
              "--prometheus-host", LOOPBACK, "--prometheus-port", str(ports.metrics),
              "--worker-urls", *workers, "--policy", spec.policy)
    url = f"http://{LOOPBACK}:{ports.api}"
    if spec.family == VLLM_ROUTER:
        return Launch((str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"), url)
    if spec.family == SGLANG_ROUTER:
        env = {"HF_ENDPOINT": f"http://{LOOPBACK}:{closed_port}", "HF_HUB_OFFLINE": "1"}
        return Launch((str(venv / "bin" / "sglang-router"), "launch", *common, "--log-level", "warn"),
                      url, env)
    raise ValueError(f"{spec.family} is not a peer router")


def kvroute_launch(python: str, spec: RouterSpec, workers: Sequence[str], port: int, config: Path,
                   redis_url: str | None = None) -> Launch:
    """The command line of ``kvroute serve`` on loopback (``config``: its TOML file); with several
    processes, ``serve --processes N`` shares one port between them and, without ``redis_url``,
    starts its own private Redis for their shared state."""
    if spec.family != KVROUTE:
        raise ValueError(f"{spec.family} is not kvroute")
    if not workers:
        raise ValueError("no workers")
    argv: list[str] = [python, "-c", "from kvroute.cli import main; main()", "serve",
                       "--host", LOOPBACK, "--port", str(port), "--policy", spec.policy,
                       "--config", str(config), "--log-level", "warning"]
    for url in workers:
        argv += ["--worker", url]
    if spec.processes > 1:
        argv += ["--processes", str(spec.processes)]
    if redis_url is not None:
        argv += ["--redis", redis_url]
    return Launch(tuple(argv), f"http://{LOOPBACK}:{port}")


def kvroute_config(probe_interval_s: float) -> str:
    """kvroute's TOML for the run: probe the replicas once per simulated second, as a real fleet at
    ``--speed 1`` would be probed once per second (the peers track load from their own counters)."""
    if probe_interval_s <= 0:
        raise ValueError("probe_interval_s must be > 0")
    return f"probe_interval_s = {probe_interval_s!r}\n"
