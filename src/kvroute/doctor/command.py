"""``kvroute doctor``: read what engines say about themselves and say what stops their prefix cache.

A 0% hit rate can be a default rather than a limit of the architecture: hybrid models run with
prefix caching off, ``--enable-prefix-caching`` needs ``--mamba-cache-mode align``, and short chats
gain nothing until ``--prefix-match-unit`` lets a hit land where the state is.  The doctor reads
``/metrics``, ``/v1/models``, ``/server_info`` and startup logs, and reports each problem with its
exact fix (see docs/doctor.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvroute.doctor.facts import TrafficAssumptions
from kvroute.doctor.finding import Severity
from kvroute.doctor.report import render_report, report_json
from kvroute.doctor.session import DoctorOptions, run_doctor


def doctor(
    urls: Annotated[list[str] | None, typer.Argument(
        help="Base URLs of engines (http://host:8000) or of a kvroute router, whose workers are all checked.",
        show_default=False)] = None,
    log: Annotated[list[Path] | None, typer.Option(
        "--log", help="A vLLM startup log: one per URL in the same order, or on its own without URLs.",
        exists=True, dir_okay=False, readable=True, show_default=False)] = None,
    probe: Annotated[bool, typer.Option(
        "--probe", help="Send a prompt twice and grow it into a conversation: evidence of hits.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    admin_token: Annotated[str | None, typer.Option(
        "--admin-token", envvar="KVROUTE_ADMIN_TOKEN", help="A router's admin token, to list its workers.",
        show_default=False)] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Bearer key the engines require (vLLM --api-key).", show_default=False)] = None,
    sessions: Annotated[int | None, typer.Option(
        "--sessions", min=1, help="Conversations live at once per replica [default: max_num_seqs].",
        show_default=False)] = None,
    context_tokens: Annotated[int | None, typer.Option(
        "--context-tokens", min=1, help="Typical prompt length [default: the engine's measured mean].",
        show_default=False)] = None,
    probe_tokens: Annotated[int | None, typer.Option(
        "--probe-tokens", min=16, help="Prompt length for --probe [default: 3000 or 3 match units].",
        show_default=False)] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds per HTTP request.")] = 30.0,
) -> None:
    """Check engines' prefix-cache configuration and say exactly what to change.

    Exits 1 when any finding is an error (caching cannot work, or the engine cannot start).
    """
    if not urls and not log:
        raise typer.BadParameter("give at least one URL or --log FILE")
    logs = tuple((str(path), path.read_text(encoding="utf-8", errors="replace")) for path in log or ())
    options = DoctorOptions(
        urls=tuple(urls or ()), logs=logs, probe=probe, probe_tokens=probe_tokens, admin_token=admin_token,
        api_key=api_key, timeout_s=timeout,
        traffic=TrafficAssumptions(typical_prompt_tokens=context_tokens, concurrent_sessions=sessions),
    )
    try:
        report = asyncio.run(run_doctor(options))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if json_out:
        typer.echo(report_json(report).decode())
    else:
        render_report(report, Console())
    if report.worst() is Severity.ERROR:
        raise typer.Exit(1)
