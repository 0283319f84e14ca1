"""``kvroute serve``: run the router in front of a fleet until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import textwrap
from pathlib import Path
from typing import Annotated, Any

import typer

from kvroute.event_loop import run_event_loop
from kvroute.log_setup import setup_logging
from kvroute.router_settings import Settings, settings_groups
from kvroute.routing.config import policies_help, policy_names, settings_help
from kvroute.startup import check_port_free, fail, host_port, listen_error

log = logging.getLogger("kvroute.server")

SERVE_EPILOG = (
    "Every setting can also be set in the TOML file (--config) or as KVROUTE_<NAME> in the "
    "environment; flags win over both. The per-model routing settings ([routing] for every model, "
    "[models.NAME] for one, --set NAME=VALUE from here) are listed by: kvroute serve --help-settings. "
    "Reference: docs/server.md; logs, access log, tracing and keys: docs/operations.md."
)

_FLEET, _LISTEN, _ROUTING, _KEYS, _LOGS = ("Fleet", "Listening", "Routing", "Keys and tokens",
                                           "Logs and tracing")


# What --help-settings cannot list: the settings of the router process itself.
_TOP_LEVEL = ("Listener: host, port, max_connections and the client limits and timeouts are top-level "
              "settings, like the fleet's (workers, discovery, retries, the sick-replica deadlines) and "
              "the keys: not per model, not in [routing]; kvroute serve --help shows their flags, "
              "docs/server.md (Configuration) lists them all.")


def _show_settings(value: bool) -> None:
    if value:
        width = max(40, min(shutil.get_terminal_size().columns, 100) - 1)
        policies = "\n".join(textwrap.fill(part.strip(), width=width, initial_indent="  ",
                                           subsequent_indent="      ") for part in policies_help().split(";"))
        settings, top_level = settings_help(width, settings_groups()), textwrap.fill(_TOP_LEVEL, width=width)
        typer.echo(f"Policies (policy, --policy):\n{policies}\n\n{settings}\n\n{top_level}")
        raise typer.Exit()


def _routing_overrides(pairs: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` pairs as a [routing] table; values read as TOML (numbers, true, "auto", [1, 2])."""
    import tomllib

    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected NAME=VALUE, got {pair!r}")
        try:
            out[name.strip()] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[name.strip()] = text.strip()
    return out


def serve(
    worker: Annotated[list[str] | None, typer.Option(
        "--worker", "-w", metavar="URL", rich_help_panel=_FLEET,
        help="Worker base URL (repeat for each); replaces the config file's list.")] = None,
    discover: Annotated[list[str] | None, typer.Option(
        "--discover", metavar="SOURCE", rich_help_panel=_FLEET,
        help="Find workers at run time, repeatable: dns://NAME:PORT (every A/AAAA record) or "
             "file://PATH (one URL a line); docs/discovery.md.")] = None,
    kv_events: Annotated[list[str] | None, typer.Option(
        "--kv-events", metavar="WORKER=PUB[,REPLAY]", rich_help_panel=_FLEET,
        help="Where a worker publishes its KV-cache events, or WORKER=off; repeatable (default: "
             "where the engine says, else tcp://HOST:5557).")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", metavar="PATH", rich_help_panel=_FLEET,
        help="TOML config file (default: $KVROUTE_CONFIG).")] = None,
    host: Annotated[str | None, typer.Option(
        metavar="ADDRESS", rich_help_panel=_LISTEN, help="Address to listen on (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(
        metavar="PORT", rich_help_panel=_LISTEN, help="Port to listen on (default 8080).")] = None,
    model_alias: Annotated[list[str] | None, typer.Option(
        "--model-alias", metavar="PATTERN=MODEL", rich_help_panel=_ROUTING,
        help="Serve model names matching PATTERN (a name, or a glob: 'claude-*') with MODEL; "
             "repeatable, exact names first.")] = None,
    default_model: Annotated[str | None, typer.Option(
        metavar="MODEL", rich_help_panel=_ROUTING,
        help="Model for names no worker serves and no alias maps (default: none; they get 404).")] = None,
    sync_secret: Annotated[str | None, typer.Option(
        metavar="SECRET", rich_help_panel=_KEYS,
        help="Secret signing the messages shared through Redis, the same on every instance "
             "(prefer KVROUTE_SYNC_SECRET or --sync-secret-file).")] = None,
    sync_secret_file: Annotated[Path | None, typer.Option(
        metavar="PATH", rich_help_panel=_KEYS, help="File holding the sync secret.")] = None,
    processes: Annotated[int | None, typer.Option(
        metavar="N", rich_help_panel=_LISTEN,
        help="Router processes listening on the same port, sharing routing state through Redis "
             "(--redis, or a private redis-server) (default 1).")] = None,
    redis: Annotated[str | None, typer.Option(
        metavar="URL", rich_help_panel=_LISTEN,
        help="Redis URL to share routing state with other router instances.")] = None,
    policy: Annotated[str | None, typer.Option(
        metavar="NAME", rich_help_panel=_ROUTING,
        help=f"Routing policy for every model without its own: {', '.join(policy_names())} "
             "(default auto; each is described by --help-settings).")] = None,
    routing: Annotated[list[str] | None, typer.Option(
        "--set", metavar="NAME=VALUE", rich_help_panel=_ROUTING,
        help="A [routing] setting for every model (repeatable), e.g. --set stay_tokens=1024.")] = None,
    retries: Annotated[int | None, typer.Option(
        metavar="N", rich_help_panel=_ROUTING,
        help="Other workers tried before giving up (default 2).")] = None,
    help_settings: Annotated[bool, typer.Option(
        "--help-settings", is_eager=True, callback=_show_settings, rich_help_panel=_ROUTING,
        help="List every per-model routing setting with its default, and exit.")] = False,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", metavar="KEY", rich_help_panel=_KEYS,
        help="A key clients must send on the inference routes (Authorization: Bearer KEY or "
             "x-api-key: KEY); repeatable (prefer --api-key-file or KVROUTE_API_KEYS).")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", metavar="PATH", rich_help_panel=_KEYS,
        help="A file of client keys, one a line.")] = None,
    worker_api_key: Annotated[str | None, typer.Option(
        metavar="KEY", rich_help_panel=_KEYS,
        help="The key the router sends to the workers (prefer KVROUTE_WORKER_API_KEY).")] = None,
    admin_token: Annotated[str | None, typer.Option(
        metavar="TOKEN", rich_help_panel=_KEYS,
        help="Token the admin API requires (prefer KVROUTE_ADMIN_TOKEN).")] = None,
    worker_header: Annotated[bool | None, typer.Option(
        "--worker-header/--no-worker-header", rich_help_panel=_KEYS,
        help="Send x-kvroute-worker in responses.")] = None,
    log_level: Annotated[str, typer.Option(
        metavar="LEVEL", rich_help_panel=_LOGS, help="debug, info, warning or error.")] = "info",
    log_format: Annotated[str | None, typer.Option(
        metavar="FORMAT", rich_help_panel=_LOGS,
        help="text or json (one JSON object a line) (default text).")] = None,
    access_log: Annotated[bool | None, typer.Option(
        "--access-log/--no-access-log", rich_help_panel=_LOGS,
        help="One line per inference request (status, model, worker, timings, tokens; never the "
             "prompt).")] = None,
    log_prompts: Annotated[bool | None, typer.Option(
        "--log-prompts/--no-log-prompts", rich_help_panel=_LOGS,
        help="Include prompt text in decision logs.")] = None,
    otlp_endpoint: Annotated[str | None, typer.Option(
        metavar="URL", rich_help_panel=_LOGS,
        help="Export trace spans over OTLP/HTTP to this collector (http://host:4318; default "
             "$OTEL_EXPORTER_OTLP_ENDPOINT); needs kvroute[otel].")] = None,
) -> None:
    """Route OpenAI- and Anthropic-compatible requests to the replica holding their prefix."""
    from kvroute.router_settings import SettingsError

    try:
        routing_table = _routing_overrides(routing or [])
    except ValueError as exc:
        fail("serve", f"--set: {exc}")
    overrides = {"workers": worker or None, "discover": discover or None, "host": host, "port": port,
                 "policy": policy, "admin_token": admin_token, "redis_url": redis, "retries": retries,
                 "worker_header": worker_header, "log_prompts": log_prompts, "processes": processes,
                 "aliases": model_alias or None, "default_model": default_model,
                 "kv_events": kv_events or None,
                 "log_format": log_format, "access_log": access_log, "otlp_endpoint": otlp_endpoint,
                 "api_keys": api_key or None, "worker_api_key": worker_api_key,
                 "api_key_file": None if api_key_file is None else str(api_key_file),
                 "sync_secret": sync_secret,
                 "sync_secret_file": None if sync_secret_file is None else str(sync_secret_file)}
    try:
        settings = Settings.load(config, overrides=overrides)
        if routing_table:
            settings = settings.replace(routing={**settings.routing, **routing_table})
    except SettingsError as exc:
        fail("serve", str(exc))
    if not settings.workers and not settings.discover and not settings.admin_token:
        fail("serve", "no workers: pass --worker URL or --discover SOURCE, list them in the "
                      "config file, or set an admin token to register them at run time")
    try:
        setup_logging(log_level, settings.log_format)
    except ValueError as exc:
        fail("serve", f"--log-level: {exc}")
    if settings.otlp_endpoint is not None:
        from kvroute.server.tracing import sdk_missing

        if (missing := sdk_missing()) is not None:
            fail("serve", missing, code=1)
    if settings.processes > 1:
        if settings.redis_url is None and shutil.which("redis-server") is None:
            fail("serve", f"--processes {settings.processes} needs Redis to share routing state between the "
                          "router processes: pass --redis URL, or install redis-server (apt-get install "
                          "redis-server) so that kvroute can start a private one")
        from kvroute.server.processes import Supervisor

        code = Supervisor(settings, log_level=log_level).run()
        if code:
            raise typer.Exit(code)
        return
    try:
        cut = run_event_loop(_serve(settings))
    except StartupError as exc:
        fail("serve", str(exc), code=1)
    if cut:
        from kvroute.server.app import CUT_EXIT_CODE

        raise typer.Exit(CUT_EXIT_CODE)


class StartupError(RuntimeError):
    """The router could not start (its port is taken, tracing is asked for but not installed)."""


async def _serve(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; returns how many requests the shutdown timeout cut."""
    from kvroute.api.local_tokens import TemplateError
    from kvroute.server.app import CUT_EXIT_CODE, freeze_startup_heap, start_router
    from kvroute.server.dashboard import setup_dashboard
    from kvroute.server.tracing import TracingUnavailable

    # With settings.redis_url, start_router shares routing state through the Redis bus.
    try:
        check_port_free(settings.host, settings.port)  # before the workers are probed
        running = await start_router(settings, host=settings.host, port=settings.port,
                                     setup=(setup_dashboard,))
    except OSError as exc:
        raise StartupError(listen_error(host_port(settings.host, settings.port), exc)) from None
    except (TracingUnavailable, TemplateError) as exc:
        raise StartupError(str(exc)) from None
    freeze_startup_heap()
    healthy = sum(1 for s in running.registry.states() if s.healthy)
    discovering = f", discovering through {', '.join(settings.discover)}" if settings.discover else ""
    log.info("kvroute listening on %s: %d workers (%d healthy)%s, policy %s, up to %d client connections",
             running.url, len(running.registry), healthy, discovering, settings.policy,
             running.front.limits.max_connections)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: finishing in-flight requests (up to %.0f s)", settings.shutdown_timeout_s)
    report = await running.close()
    if report.cut:
        log.error("shut down with %d request(s) cut by shutdown_timeout_s (%.0f s); exiting with status %d",
                  report.cut, settings.shutdown_timeout_s, CUT_EXIT_CODE)
    else:
        log.info("shut down cleanly")
    return report.cut
