"""``kvroute canary``: are replies still correct with the cache on?

Experimental prefix caching (Mamba align mode, especially with speculative decoding) has silently
corrupted a small fraction of replies upstream: empty content, or a run of ``!``.  The canary sends
N requests that share one long prefix, each ending in a different arithmetic question with a
known answer, checks every reply exactly, and bounds the failure rate (see docs/doctor.md).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.console import Console

from kvroute.canary.run import CanaryError, CanaryOptions, run_canary
from kvroute.canary.summary import render_summary, summary_json


def canary(
    target: Annotated[str, typer.Option(
        "--target", help="Base URL of an engine or a kvroute router (http://host:8000).",
        show_default=False)],
    requests: Annotated[int, typer.Option("--requests", "-n", min=1, help="Questions to ask.")] = 150,
    prefix_tokens: Annotated[int, typer.Option(
        "--prefix-tokens", min=0, help="Length of the prefix every request shares.")] = 13_000,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Requests in flight.")] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Reply length limit.")] = 16,
    model: Annotated[str | None, typer.Option(
        "--model", help="Model to ask (default: the first model /v1/models lists).", show_default=False)]
        = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Bearer key the target requires.", show_default=False)] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds per request.")] = 300.0,
    seed: Annotated[int, typer.Option(
        "--seed", help="Chooses the questions (the prefix is new each run).")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Ask N arithmetic questions behind one long shared prefix and check every answer exactly.

    Exits 1 if any reply is wrong, empty, malformed, truncated or failed; 2 if the run cannot start.
    """
    options = CanaryOptions(target=target, requests=requests, prefix_tokens=prefix_tokens,
                            concurrency=concurrency, max_tokens=max_tokens, model=model, api_key=api_key,
                            timeout_s=timeout, seed=seed)
    try:
        summary = asyncio.run(run_canary(options))
    except CanaryError as exc:
        typer.echo(f"kvroute canary: {exc}", err=True)
        raise typer.Exit(2) from None
    if json_out:
        typer.echo(summary_json(summary, target).decode())
    else:
        render_summary(summary, target, Console())
    if not summary.passed:
        raise typer.Exit(1)
