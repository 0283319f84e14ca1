"""Router settings: defaults, then a TOML file, then ``KVROUTE_*`` environment variables, then flags.

Every scalar setting ``name`` can be set as ``name = ...`` at the top level of the TOML file, as the
environment variable ``KVROUTE_<NAME>`` and, for the common ones, as a ``kvroute serve`` flag.
Workers, per-model settings and model aliases are tables in the file; ``KVROUTE_WORKERS``
(comma-separated URLs) and ``--worker`` replace the file's worker list, ``KVROUTE_DISCOVER`` and
``--discover`` its discovery sources, ``KVROUTE_ALIASES`` (comma-separated ``PATTERN=MODEL``) and
``--model-alias`` its ``[aliases]``.  See docs/server.md for the full reference.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvroute.api.model_aliases import AliasError, ModelAliases, parse_alias
from kvroute.api.requests import RequestOptions
from kvroute.api.tokenizer_settings import TokenizerSettings
from kvroute.fleet.breaker import BreakerSettings
from kvroute.fleet.discovery import parse_source
from kvroute.fleet.kv_event_sources import KvEventSettings
from kvroute.guard.blocks import GUARD
from kvroute.routing.config import ModelSettings, RoutingConfig, blocks_of, defaults
from kvroute.routing.policies import routing_groups
from kvroute.routing.settings import SettingsGroup
from kvroute.sync.trust import MIN_SECRET_BYTES

_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("0", "false", "no", "off", ""))
_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
LOG_FORMATS = ("text", "json")


class SettingsError(ValueError):
    """A setting is missing, misspelt or of the wrong type; the message names it."""


def settings_groups() -> tuple[SettingsGroup, ...]:
    """Every per-model settings group a router carries, in the order help and docs list them: the
    routing core's (placement with each policy's block, cache, overload), then the fleet guard's,
    which sits above routing and so joins here; how exact mode tokenizes (the server's) joins
    the cache group.  The one place the groups are assembled."""
    placement, cache, overload = routing_groups()
    return placement, cache.joined((TokenizerSettings,)), overload, GUARD


def model_settings(**values: Any) -> ModelSettings:
    """One model's settings, carrying every group of ``settings_groups`` (ValueError names what
    is wrong)."""
    return ModelSettings.carrying(blocks_of(settings_groups()), **values)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A replica given in the configuration.

    ``id`` defaults to the URL's ``host:port`` so that every router instance derives the same id.
    ``models`` declares what the worker serves (otherwise discovered from its ``/v1/models``);
    ``max_num_seqs`` is for engines that do not say (vLLM exposes it nowhere by default).
    """

    url: str
    id: str | None = None
    models: tuple[str, ...] = ()
    max_num_seqs: int | None = None


class ModelTable(Mapping[str, Any]):
    """One ``[models.NAME]`` table: any per-model routing setting (every field of every routing
    settings block, docs/server.md), applied on top of ``policy`` and ``[routing]``."""

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(defaults(settings_groups())))
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(unknown)}")
        self._values = dict(values)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ModelTable({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``kvroute serve`` and ``start_router`` need to run one router instance."""

    workers: tuple[WorkerSpec, ...] = ()
    # Discovery of replicas (docs/discovery.md): dns://NAME:PORT and file://PATH sources, each
    # looked up every discover_interval_s; an empty answer is acted on only after
    # discover_empty_rounds of them in a row.
    discover: tuple[str, ...] = ()
    discover_interval_s: float = 5.0
    discover_empty_rounds: int = 2
    policy: str = "auto"
    models: Mapping[str, ModelTable] = field(default_factory=dict)
    # [routing]: RoutingConfig fields (index size, session expiry, ...) and per-model settings
    # (slack_steps, stay_tokens, ...) that apply to every model.
    routing: Mapping[str, Any] = field(default_factory=dict)
    # [requests]: RequestOptions fields (session_sources, extra_session_headers, ...).
    requests: Mapping[str, Any] = field(default_factory=dict)
    # [aliases]: model-name pattern -> served model, first match in order (api/model_aliases.py);
    # default_model takes names nothing serves.  The answer names the model the client asked for.
    aliases: Mapping[str, str] = field(default_factory=dict)
    default_model: str | None = None
    host: str = "127.0.0.1"
    # Not 8000: that is the port of the vLLM servers the router usually sits in front of.
    port: int = 8080
    admin_token: str | None = None
    worker_header: bool = True
    max_body_bytes: int = 32 * 1024 * 1024
    # What the listening side accepts from a client (docs/reliability.md): request line plus
    # headers (414/431 beyond; chunk extensions and trailers alike), header count (431), and how
    # long a request's head, its whole body and an idle keep-alive connection may take; after the
    # grace a body must also average the minimum rate (0: none).
    max_header_bytes: int = 64 * 1024
    max_headers: int = 128
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    body_min_rate_bytes_s: float = 1024.0
    body_min_rate_grace_s: float = 10.0
    keepalive_timeout_s: float = 60.0
    # Open client connections; 0: derived from the open-file limit (raised to its hard limit at start).
    max_connections: int = 0
    # Who may read /metrics and the dashboard: "loopback" (clients on this machine; others need a
    # token), "token" (everyone needs one) or "open".  The token: metrics_token or admin_token.
    metrics_access: str = "loopback"
    metrics_token: str | None = None
    retries: int = 2
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    failure_threshold: int = 3
    upstream_connect_timeout_s: float = 5.0
    # Longest silence accepted from a worker (before its first byte or between two chunks).
    upstream_read_timeout_s: float = 600.0
    # Sick replicas (docs/server.md): an attempt gets predicted TTFT x factor within [floor, ceiling]
    # to send its first byte (a plain answer also max_tokens x decode), else it is retried elsewhere.
    first_byte_factor: float = 4.0
    first_byte_floor_s: float = 10.0
    first_byte_ceiling_s: float = 300.0
    first_byte_decode_s_per_token: float = 0.05
    # Silence once an answer's body has started: stream_idle_factor x the worker's usual gap between
    # reads within [stream_idle_floor_s, stream_idle_timeout_s] (the ceiling, also used while the
    # gap is not known yet, and always with factor 0), then the stream ends with an error event.
    stream_idle_timeout_s: float = 120.0
    stream_idle_floor_s: float = 30.0
    stream_idle_factor: float = 50.0
    # The largest SSE event accepted from a worker; a larger one makes the answer malformed.
    max_event_bytes: int = 1024 * 1024
    # Circuit breaker: breaker_failures attempts failed in a row take a replica out for the cool-down
    # (doubled after each failed half-open trial, up to the max).
    breaker_failures: int = 3
    breaker_cooldown_s: float = 10.0
    breaker_max_cooldown_s: float = 160.0
    # Latency outliers: TTFT relative to prediction this many times the fleet median (0: off).
    outlier_factor: float = 3.0
    outlier_min_samples: int = 20
    outlier_min_excess_s: float = 1.0
    outlier_max_ejected_fraction: float = 1 / 3
    connections_per_worker: int = 1024
    # Idle upstream connections are closed before the engine's own keep-alive timeout (uvicorn: 5 s)
    # would close them under a request being sent.
    upstream_keepalive_s: float = 4.0
    shutdown_timeout_s: float = 30.0
    log_prompts: bool = False
    # The dashboard (/dashboard) and its JSON are read-only; with this they need the admin token too.
    dashboard_requires_token: bool = False
    redis_url: str | None = None
    # Engines' KV-cache events (docs/routing.md, "Exact cache state"): [kv_events] names each
    # worker's endpoint (worker URL or id -> "PUB[,REPLAY]", "off": none); other workers are
    # subscribed at the templates filled with their host (empty: not at all), unless several
    # workers share a host.  Ranks: data-parallel ranks per worker, on the ports + rank.
    kv_events: Mapping[str, str] = field(default_factory=dict)
    kv_events_endpoint: str = "tcp://{host}:5557"
    kv_events_replay_endpoint: str = ""
    kv_events_ranks: int = 1
    kv_events_topic: str = ""
    # Shared secret signing the Redis sync messages, or a file holding it; and how far in the future
    # a peer's time or epoch may be (docs/multi-instance.md#trust-model).
    sync_secret: str | None = None
    sync_secret_file: str | None = None
    sync_max_clock_skew_s: float = 60.0
    # Router processes listening on the same port (``kvroute serve`` only; see docs/server.md).
    processes: int = 1
    # Operations (docs/operations.md): one log line per inference request, the log lines' format
    # ("text" or "json"), OTLP/HTTP trace export (a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT).
    access_log: bool = False
    log_format: str = "text"
    otlp_endpoint: str | None = None
    # Keys a client must send on the inference routes and /v1/models (Authorization: Bearer, or
    # x-api-key), and a file of more, one a line; empty: no key needed.  The router sends
    # worker_api_key to the workers instead (none: no key, or the client's own when api_keys is empty).
    api_keys: tuple[str, ...] = ()
    api_key_file: str | None = None
    worker_api_key: str | None = None

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Settings:
        """Build settings from defaults, the TOML file at ``path`` (or ``$KVROUTE_CONFIG``), the
        environment and ``overrides`` (flag values; ``None`` entries are ignored), later winning."""
        env = os.environ if env is None else env
        raw: dict[str, Any] = {}
        path = path or env.get("KVROUTE_CONFIG") or None
        if path is not None:
            try:
                raw.update(tomllib.loads(Path(path).read_text()))
            except OSError as exc:
                raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from exc
            except UnicodeDecodeError:
                raise SettingsError(f"config file {path} is not UTF-8 text") from None
            except tomllib.TOMLDecodeError as exc:
                raise SettingsError(f"config file {path} is not valid TOML: {exc}") from exc
        raw.update(_from_env(env))
        raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Settings:
        """Validate a plain mapping (the TOML document's shape) into settings."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            if name == "workers":
                values[name] = tuple(parse_worker_spec(w) for w in _as_list(value, "workers"))
            elif name == "discover":
                values[name] = _discovery_sources(value)
            elif name == "models":
                if not isinstance(value, Mapping):
                    raise SettingsError("models must be a table of model name -> settings")
                values[name] = {str(m): _model(str(m), s) for m, s in value.items()}
            elif name in ("routing", "requests"):
                if not isinstance(value, Mapping):
                    raise SettingsError(f"{name} must be a table")
                values[name] = dict(value)
            elif name == "kv_events":
                values[name] = _kv_events(value)
            elif name == "aliases":
                values[name] = _aliases(value)
            elif name == "api_keys":
                values[name] = _api_keys(value)
            else:
                values[name] = _coerce(name, value, known[name].default)
        for token in ("admin_token", "metrics_token", "default_model", "worker_api_key", "otlp_endpoint",
                      "api_key_file", "sync_secret", "sync_secret_file"):
            if values.get(token) == "":
                values[token] = None  # an empty KVROUTE_ADMIN_TOKEN means "no token"
        if values.get("api_key_file"):
            keys = values.get("api_keys", ()) + read_api_key_file(values["api_key_file"])
            values["api_keys"] = tuple(dict.fromkeys(keys))  # a child process re-reads the file
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Reject values that cannot work, naming the setting."""
        positive = ("max_body_bytes", "probe_interval_s", "probe_timeout_s", "failure_threshold",
                    "upstream_connect_timeout_s", "upstream_read_timeout_s", "connections_per_worker",
                    "upstream_keepalive_s", "max_header_bytes", "max_headers", "header_timeout_s",
                    "body_timeout_s", "keepalive_timeout_s", "discover_interval_s", "discover_empty_rounds",
                    "max_event_bytes")
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be positive")
        if self.first_byte_factor < 0 or self.first_byte_decode_s_per_token < 0:
            raise SettingsError("first_byte_factor and first_byte_decode_s_per_token must not be negative")
        if not 0 < self.first_byte_floor_s <= self.first_byte_ceiling_s:
            raise SettingsError("first_byte_floor_s must be positive and at most first_byte_ceiling_s")
        if not 0 < self.stream_idle_floor_s <= self.stream_idle_timeout_s:
            raise SettingsError("stream_idle_floor_s must be positive and at most stream_idle_timeout_s")
        if self.stream_idle_factor < 0:
            raise SettingsError("stream_idle_factor must not be negative")
        try:
            self.breaker_settings()
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if self.body_min_rate_bytes_s < 0 or self.body_min_rate_grace_s < 0:
            raise SettingsError("body_min_rate_bytes_s and body_min_rate_grace_s must not be negative")
        if self.max_connections < 0:
            raise SettingsError("max_connections must not be negative (0: from the open-file limit)")
        if self.metrics_access not in ("loopback", "token", "open"):
            raise SettingsError(
                f"metrics_access must be loopback, token or open, got {self.metrics_access!r}")
        if self.metrics_access == "token" and not (self.metrics_token or self.admin_token):
            raise SettingsError("metrics_access = token needs metrics_token or admin_token")
        if self.processes < 1:
            raise SettingsError("processes must be at least 1")
        if self.retries < 0 or self.shutdown_timeout_s < 0:
            raise SettingsError("retries and shutdown_timeout_s must not be negative")
        if not 0 <= self.port <= 65535:
            raise SettingsError("port must be between 0 and 65535")
        if self.dashboard_requires_token and not self.admin_token:
            raise SettingsError("dashboard_requires_token needs admin_token")
        if self.kv_events_ranks < 1:
            raise SettingsError("kv_events_ranks must be at least 1")
        try:
            kv = self.kv_event_settings()
            for url in ("http://localhost", *self.kv_events):
                kv.for_worker(url, url)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError("redis_url must be a redis://, rediss:// (TLS) or unix:// URL")
        if self.log_format not in LOG_FORMATS:
            raise SettingsError(f"log_format must be {' or '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise SettingsError(f"otlp_endpoint must be an http:// or https:// URL (OTLP/HTTP), "
                                f"got {self.otlp_endpoint!r}")
        if self.sync_max_clock_skew_s < 0:
            raise SettingsError("sync_max_clock_skew_s must not be negative")
        self.sync_key()
        self.routing_config()
        self.request_options()
        self.model_aliases()

    def kv_event_settings(self) -> KvEventSettings:
        """Where the workers publish their KV-cache events."""
        return KvEventSettings(self.kv_events, self.kv_events_endpoint, self.kv_events_replay_endpoint,
                               self.kv_events_ranks, self.kv_events_topic)

    def sync_key(self) -> bytes | None:
        """The secret signing the sync messages: ``sync_secret``, else ``sync_secret_file``'s content
        (surrounding whitespace stripped), else None."""
        if self.sync_secret is not None and self.sync_secret_file is not None:
            raise SettingsError("give sync_secret or sync_secret_file, not both")
        if self.sync_secret_file is not None:
            try:
                key = Path(self.sync_secret_file).read_bytes().strip()
            except OSError as exc:
                raise SettingsError(f"cannot read sync_secret_file {self.sync_secret_file}: {exc.strerror}"
                                    ) from None
        elif self.sync_secret is not None:
            key = self.sync_secret.strip().encode()
        else:
            return None
        if len(key) < MIN_SECRET_BYTES:
            raise SettingsError(f"the sync secret must be at least {MIN_SECRET_BYTES} bytes "
                                "(e.g. `openssl rand -hex 32`)")
        return key

    def breaker_settings(self) -> BreakerSettings:
        """The circuit breaker's and the outlier detector's settings."""
        return BreakerSettings(
            failures=self.breaker_failures, cooldown_s=self.breaker_cooldown_s,
            max_cooldown_s=self.breaker_max_cooldown_s, outlier_factor=self.outlier_factor,
            outlier_min_samples=self.outlier_min_samples, outlier_min_excess_s=self.outlier_min_excess_s,
            max_ejected_fraction=self.outlier_max_ejected_fraction)

    def routing_config(self) -> RoutingConfig:
        """The scheduler's configuration: ``policy`` and ``[routing]`` for every model, then each
        ``[models.NAME]`` table on top."""
        model_fields = set(defaults(settings_groups()))
        config_fields = {f.name for f in dataclasses.fields(RoutingConfig)} - {"default", "models"}
        unknown = sorted(set(self.routing) - model_fields - config_fields)
        if unknown:
            raise SettingsError(f"unknown setting(s) in [routing]: {', '.join(unknown)}")
        shared: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in self.routing.items() if k in model_fields}
        try:
            default = model_settings(**{**shared, "policy": shared.get("policy", self.policy)})
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"routing settings: {exc}") from None
        models = {}
        for name, m in self.models.items():
            try:
                models[name] = default.replace(**m)
            except (TypeError, ValueError) as exc:
                raise SettingsError(f"models.{name}: {exc}") from None
        try:
            return RoutingConfig(default=default, models=models,
                                 **{k: v for k, v in self.routing.items() if k in config_fields})
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"routing settings: {exc}") from None

    def request_options(self) -> RequestOptions:
        """How request bodies and headers are read (session id sources, prefix limits)."""
        try:
            options: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                       for k, v in self.requests.items()}
            return RequestOptions(**options)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"[requests] settings: {exc}") from None

    def model_aliases(self) -> ModelAliases:
        """The model-name rules: ``[aliases]`` and ``default_model``."""
        try:
            return ModelAliases(self.aliases, self.default_model)
        except AliasError as exc:
            raise SettingsError(str(exc)) from None

    def replace(self, **changes: Any) -> Settings:
        """A copy with some settings changed (validated)."""
        settings = dataclasses.replace(self, **changes)
        settings.validate()
        return settings


def _api_keys(value: Any) -> tuple[str, ...]:
    """``api_keys`` from TOML (a list or one string) or the environment (comma-separated)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(k, str) for k in items):
        raise SettingsError("api_keys must be a list of strings")
    return tuple(k.strip() for k in items if k.strip())


def read_api_key_file(path: str | Path) -> tuple[str, ...]:
    """The keys in ``path``: one a line; blank lines and lines starting with ``#`` are skipped."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"cannot read api_key_file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"api_key_file {path} is not text") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))
    if not keys:
        raise SettingsError(f"api_key_file {path} holds no key")
    return keys


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        value = env.get(f"KVROUTE_{f.name.upper()}")
        if value is None or f.name in ("models", "routing", "requests"):
            continue
        if f.name in ("workers", "discover", "aliases"):
            out[f.name] = [u.strip() for u in value.split(",") if u.strip()]
        else:
            out[f.name] = value
    return out


def _as_list(value: Any, name: str) -> list[Any]:
    if isinstance(value, str | Mapping):
        return [value]
    if isinstance(value, list | tuple):
        return list(value)
    raise SettingsError(f"{name} must be a list")


def _kv_events(value: Any) -> dict[str, str]:
    """``[kv_events]`` (worker URL or id -> ``PUB[,REPLAY]``), or flag values ``URL=PUB[,REPLAY]``."""
    if isinstance(value, str | list | tuple):
        table: dict[str, str] = {}
        for item in _as_list(value, "kv_events"):
            worker, sep, spec = str(item).partition("=")
            if not sep or not worker.strip():
                raise SettingsError(f"kv_events: expected WORKER=PUB[,REPLAY], got {item!r}")
            table[worker.strip().rstrip("/")] = spec.strip()
        return table
    if not isinstance(value, Mapping):
        raise SettingsError("kv_events must be a table of worker URL -> endpoint")
    return {str(k).rstrip("/"): str(v) for k, v in value.items()}


def _discovery_sources(value: Any) -> tuple[str, ...]:
    specs = []
    for spec in _as_list(value, "discover"):
        if not isinstance(spec, str):
            raise SettingsError(f"discover must list dns://NAME:PORT or file://PATH sources, got {spec!r}")
        try:
            specs.append(parse_source(spec).spec)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    if len(set(specs)) < len(specs):
        raise SettingsError("discover lists the same source twice")
    return tuple(specs)


def _aliases(value: Any) -> dict[str, str]:
    """``[aliases]`` as a table (pattern -> model) or a list of ``PATTERN=MODEL`` strings (the
    flag, ``KVROUTE_ALIASES``), in the order given; of two entries for one pattern the later wins."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list | tuple):
        try:
            pairs = [parse_alias(item) if isinstance(item, str) else tuple(item) for item in value]
        except (AliasError, TypeError) as exc:
            raise SettingsError(f"aliases: {exc}") from None
    else:
        raise SettingsError("aliases must be a table of pattern -> model (or PATTERN=MODEL strings)")
    out: dict[str, str] = {}
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(v, str) for v in pair):
            raise SettingsError(f"aliases: each entry maps a pattern to a model name, got {pair!r}")
        out[pair[0]] = pair[1]
    return out


def parse_worker_spec(value: Any) -> WorkerSpec:
    """A worker from a bare URL or a mapping ``{url, id, models, max_num_seqs}``; raises
    ``SettingsError`` naming what is wrong."""
    if isinstance(value, WorkerSpec):
        return value
    if isinstance(value, str):
        value = {"url": value}
    if not isinstance(value, Mapping):
        raise SettingsError("each worker must be a URL or a table with a url")
    unknown = sorted(set(value) - {"url", "id", "models", "max_num_seqs"})
    if unknown:
        raise SettingsError(f"unknown worker setting(s): {', '.join(unknown)}")
    url = value.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise SettingsError(f"worker url must start with http:// or https://, got {url!r}")
    _check_worker_url(url)
    models = value.get("models", ())
    if isinstance(models, str):
        models = (models,)
    max_num_seqs = value.get("max_num_seqs")
    return WorkerSpec(
        url=url.rstrip("/"),
        id=None if value.get("id") is None else str(value["id"]),
        models=tuple(str(m) for m in models),
        max_num_seqs=None if max_num_seqs is None else _coerce("max_num_seqs", max_num_seqs, 1),
    )


def _check_worker_url(url: str) -> None:
    """Reject a worker URL that names no host, a port that is not one, or a query or fragment
    (the router appends the API's paths to the URL)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise SettingsError(f"worker url {url!r} is not valid: {exc}") from None
    if not parts.hostname:
        raise SettingsError(f"worker url {url!r} names no host")
    if port == 0:
        raise SettingsError(f"worker url {url!r}: port 0 is not a port a worker listens on")
    if parts.query or parts.fragment:
        raise SettingsError(f"worker url {url!r} must not have a query or fragment")


def _model(name: str, value: Any) -> ModelTable:
    if isinstance(value, ModelTable):
        return value
    if not isinstance(value, Mapping):
        raise SettingsError(f"models.{name} must be a table")
    known = defaults(settings_groups())
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise SettingsError(f"unknown setting(s) in models.{name}: {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for key, v in value.items():
        default = known[key]
        if isinstance(v, list):
            v = tuple(v)
        elif key == "overflow" and v != "auto":
            v = _coerce(f"models.{name}.overflow", v, 1)
            if v < 0:
                raise SettingsError(f"models.{name}.overflow must be 'auto' or a non-negative integer")
        elif default == "auto" and (isinstance(v, bool) or v == "auto"):
            pass  # a true/false/"auto" switch (flow_control, flow_session_admission)
        elif default is None:
            v = None if v is None else _coerce(f"models.{name}.{key}", v, 1)
        elif not isinstance(default, tuple):
            v = _coerce(f"models.{name}.{key}", v, default)
        values[key] = v
    return ModelTable(**values)


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Convert ``value`` to the type of ``default`` (strings from the environment included)."""
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ValueError(value)
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if value is not None and not isinstance(value, str):
            raise ValueError(value)
        return value
    except (TypeError, ValueError):
        kind = _KIND_NAMES.get(type(default), "a string")
        raise SettingsError(f"{name} must be {kind}, got {value!r}") from None
