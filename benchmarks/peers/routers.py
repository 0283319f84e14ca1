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

from kvroute.routing.flow import FlowSettings

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
    """One router configuration of the comparison: a family, a policy, for kvroute the number of
    router processes (several share routing state through Redis), and router settings: for kvroute
    ``--set NAME=VALUE`` each, for a peer ``--NAME VALUE`` each (e.g. sglang-router's
    ``queue-size``).  ``variant`` names a configuration in the label (``kvroute auto/flow``)."""

    family: str
    policy: str
    processes: int = 1
    settings: tuple[tuple[str, str], ...] = ()
    variant: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown router family {self.family!r}; expected one of {', '.join(FAMILIES)}")
        if self.processes < 1 or (self.processes > 1 and self.family != KVROUTE):
            raise ValueError("only kvroute runs as several processes")
        if any(not name or any(c.isspace() for c in name) for name, _ in self.settings):
            raise ValueError(f"router setting names must be non-empty words: {self.settings!r}")

    @property
    def label(self) -> str:
        """``family policy`` (``×N`` for several kvroute processes), then ``/variant`` when named,
        else the settings as ``+NAME=VALUE``."""
        suffix = f" ×{self.processes}" if self.processes > 1 else ""
        if self.variant:
            suffix += f"/{self.variant}"
        elif self.settings:
            suffix += " " + " ".join(f"+{name}={value}" for name, value in self.settings)
        return f"{self.family} {self.policy}{suffix}"

    def setting_args(self) -> tuple[str, ...]:
        """The settings as command-line arguments of the family's router."""
        if self.family == KVROUTE:
            return tuple(a for name, value in self.settings for a in ("--set", f"{name}={value}"))
        return tuple(a for name, value in self.settings for a in (f"--{name}", value))


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
    """``family:policy`` or ``family:policy:N`` (N kvroute processes); the policy may carry a
    ``/variant`` name for the label, and ``+NAME=VALUE`` router settings may follow, e.g.
    ``kvroute:auto:2`` or ``sglang-router:cache_aware/queue+queue-size=32``."""
    head, *extra = text.strip().split("+")
    parts = head.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"expected FAMILY:POLICY[/VARIANT][:PROCESSES][+NAME=VALUE...], got {text!r}")
    policy, _, variant = parts[1].partition("/")
    settings = []
    for item in extra:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected +NAME=VALUE, got +{item!r} in {text!r}")
        settings.append((name.strip(), value.strip()))
    processes = int(parts[2]) if len(parts) == 3 else 1
    return RouterSpec(parts[0], policy, processes, tuple(settings), variant)


# sglang-router's queue timeout, in model seconds (its default); it takes whole wall seconds.
SGLANG_QUEUE_TIMEOUT_MODEL_S = 60.0


def flow_routers(speed: float) -> tuple[RouterSpec, ...]:
    """The flow-control A/B over HTTP (docs/flow-control.md, "Over HTTP"), kvroute ``auto``
    without flow control first (every ratio is to it).  sglang-router's limits follow its
    rate-limiting guide: 4 workers on 16 GB GPUs at 4 requests each (the guide's 4-8 for a small
    GPU; about what these replicas' KV holds of this workload's requests) → 16 concurrent, a queue
    of 2× that, and its default 60 s timeout in model seconds at ``speed`` (at least 1 s)."""
    timeout = max(1, round(SGLANG_QUEUE_TIMEOUT_MODEL_S / speed))
    off = ("flow_control", "false")
    on = ("flow_control", "true")
    return (
        RouterSpec(KVROUTE, "auto", settings=(off,), variant="off"),
        RouterSpec(KVROUTE, "auto", settings=(on,), variant="flow"),
        RouterSpec(KVROUTE, "auto", settings=(on, ("flow_session_admission", "true")), variant="sessions"),
        RouterSpec(KVROUTE, "least-loaded", settings=(off,), variant="off"),
        RouterSpec(KVROUTE, "session", settings=(off,), variant="off"),
        RouterSpec(VLLM_ROUTER, "sticky_least_loaded"),
        RouterSpec(SGLANG_ROUTER, "cache_aware", variant="queue", settings=(
            ("max-concurrent-requests", "16"), ("queue-size", "32"), ("queue-timeout-secs", str(timeout)))),
    )


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
    extra = spec.setting_args()
    if spec.family == VLLM_ROUTER:
        return Launch((str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning", *extra), url)
    if spec.family == SGLANG_ROUTER:
        env = {"HF_ENDPOINT": f"http://{LOOPBACK}:{closed_port}", "HF_HUB_OFFLINE": "1"}
        return Launch((str(venv / "bin" / "sglang-router"), "launch", *common, "--log-level", "warn",
                       *extra), url, env)
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
    argv += spec.setting_args()
    return Launch(tuple(argv), f"http://{LOOPBACK}:{port}")


# Flow control's durations at their defaults, read as model seconds (virtual time's clock).
FLOW_DURATIONS_S: Mapping[str, float] = {
    name: float(getattr(FlowSettings(), name))
    for name in ("flow_aging_s", "flow_queue_ttl_s", "flow_session_idle_s")}


def kvroute_config(probe_interval_s: float, time_scale: float = 1.0) -> str:
    """kvroute's TOML for the run: probe the replicas once per simulated second, as a real fleet at
    ``--speed 1`` would be probed once per second (the peers track load from their own counters),
    and flow control's durations likewise in simulated time (``time_scale``: model seconds per
    wall second), so that a queued request waits as many model seconds as in virtual time.
    A spec's own ``--set`` overrides them."""
    if probe_interval_s <= 0 or time_scale <= 0:
        raise ValueError("probe_interval_s and time_scale must be > 0")
    routing = "".join(f"{name} = {seconds / time_scale!r}\n" for name, seconds in FLOW_DURATIONS_S.items())
    return f"probe_interval_s = {probe_interval_s!r}\n\n[routing]\n{routing}"
