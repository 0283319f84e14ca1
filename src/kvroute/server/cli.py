"""``kvroute serve``: run the router in front of a fleet until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from kvroute.event_loop import run_event_loop

# Imported before the help below is built: it registers the fleet guard's settings blocks, which
# sit above routing and join its table there.
from kvroute.router_settings import Settings
from kvroute.routing.config import policies_help, settings_help

log = logging.getLogger("kvroute.server")

SERVE_EPILOG = "Per-model routing settings ([routing] or [models.NAME] in the config file, --set):\n\n" + \
    "\n\n".join(settings_help().splitlines())


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
        "--worker", "-w", help="Worker base URL (repeat for each); replaces the config file's list.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="TOML config file (default: $KVROUTE_CONFIG).")] = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (default 8000).")] = None,
    policy: Annotated[str | None, typer.Option(
        help=f"Routing policy for every model without its own (default auto). {policies_help()}.")] = None,
    routing: Annotated[list[str] | None, typer.Option(
        "--set", metavar="NAME=VALUE",
        help="A [routing] setting for every model (repeatable), e.g. --set stay_tokens=1024; "
             "the settings are listed below.")] = None,
    admin_token: Annotated[str | None, typer.Option(
        help="Token the admin API requires (prefer KVROUTE_ADMIN_TOKEN).")] = None,
    redis: Annotated[str | None, typer.Option(
        help="Redis URL to share routing state with other router instances.")] = None,
    sync_secret: Annotated[str | None, typer.Option(
        help="Secret signing the messages shared through Redis, the same on every instance "
             "(prefer KVROUTE_SYNC_SECRET or --sync-secret-file).")] = None,
    sync_secret_file: Annotated[Path | None, typer.Option(
        help="File holding the sync secret.")] = None,
    retries: Annotated[int | None, typer.Option(help="Other workers tried before giving up.")] = None,
    worker_header: Annotated[bool | None, typer.Option(
        "--worker-header/--no-worker-header", help="Send x-kvroute-worker in responses.")] = None,
    log_prompts: Annotated[bool | None, typer.Option(
        "--log-prompts/--no-log-prompts", help="Include prompt text in decision logs.")] = None,
    processes: Annotated[int | None, typer.Option(
        help="Router processes listening on the same port, sharing routing state through Redis "
             "(--redis, or a private redis-server) (default 1).")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Route OpenAI- and Anthropic-compatible requests to the replica holding their prefix."""
    from kvroute.router_settings import SettingsError

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        routing_table = _routing_overrides(routing or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--set") from None
    overrides = {"workers": worker or None, "host": host, "port": port, "policy": policy,
                 "admin_token": admin_token, "redis_url": redis, "sync_secret": sync_secret,
                 "sync_secret_file": None if sync_secret_file is None else str(sync_secret_file),
                 "retries": retries,
                 "worker_header": worker_header, "log_prompts": log_prompts, "processes": processes}
    try:
        settings = Settings.load(config, overrides=overrides)
        if routing_table:
            settings = settings.replace(routing={**settings.routing, **routing_table})
    except SettingsError as exc:
        raise typer.BadParameter(str(exc)) from None
    if not settings.workers and not settings.admin_token:
        raise typer.BadParameter("no workers: pass --worker URL, list them in the config file, "
                                 "or set an admin token to register them at run time")
    if settings.processes > 1:
        if settings.redis_url is None and shutil.which("redis-server") is None:
            raise typer.BadParameter(
                f"--processes {settings.processes} needs Redis to share routing state between the router "
                "processes: pass --redis URL, or install redis-server (apt-get install redis-server) so "
                "that kvroute can start a private one")
        from kvroute.server.processes import Supervisor

        code = Supervisor(settings, log_level=log_level).run()
        if code:
            raise typer.Exit(code)
        return
    if run_event_loop(_serve(settings)):
        from kvroute.server.app import CUT_EXIT_CODE

        raise typer.Exit(CUT_EXIT_CODE)


async def _serve(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; returns how many requests the shutdown timeout cut."""
    from kvroute.server.app import CUT_EXIT_CODE, start_router
    from kvroute.server.dashboard import setup_dashboard

    # With settings.redis_url, start_router shares routing state through the Redis bus.
    running = await start_router(settings, host=settings.host, port=settings.port,
                                 setup=(setup_dashboard,))
    healthy = sum(1 for s in running.registry.states() if s.healthy)
    log.info("kvroute listening on %s: %d workers (%d healthy), policy %s, up to %d client connections",
             running.url, len(running.registry), healthy, settings.policy,
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
