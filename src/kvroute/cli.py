"""The ``kvroute`` command: each subcommand lives beside the code it drives."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

app = typer.Typer(
    name="kvroute",
    help="Route LLM requests to the replica that holds their prefix, never behind a busy one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Plain click help: rich's markup would eat "[routing]" and "[models.NAME]", and its option
    # tables cut long option names at 80 columns.
    rich_markup_mode=None,
)


class PanelledCommand(TyperCommand):
    """A command whose ``--help`` lists its options in sections, one per ``rich_help_panel``
    (options without one under "Options"), in the order the panels first appear."""

    # ctx and formatter are click's Context and HelpFormatter (typer vendors its own click since 0.22).
    def format_options(self, ctx: Any, formatter: Any) -> None:
        """Write the arguments, then one section of options per panel."""
        args: list[tuple[str, str]] = []
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append(record)
            else:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        for panel, records in panels.items():
            with formatter.section(panel):
                formatter.write_dl(records)


def package_version() -> str:
    """The installed kvroute's version (from its package metadata)."""
    try:
        return version("kvroute")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"kvroute {package_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_show_version,
        help="Print kvroute's version and exit.")] = False,
) -> None:
    """Route LLM requests to the replica that holds their prefix, never behind a busy one."""


# (command name, module, function). Modules import their heavy dependencies lazily so that
# `kvroute --help` and `kvroute serve` stay fast.
_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("serve", "kvroute.server.cli", "serve"),
    ("sim", "kvroute.sim.cli", "sim"),
    ("bench", "kvroute.bench.cli", "bench"),
    ("demo", "kvroute.bench.cli", "demo"),
    ("doctor", "kvroute.doctor.command", "doctor"),
    ("canary", "kvroute.canary.command", "canary"),
)

for _name, _module, _func in _COMMANDS:
    _mod = importlib.import_module(_module)
    app.command(_name, cls=PanelledCommand, epilog=getattr(_mod, f"{_func.upper()}_EPILOG", None))(
        getattr(_mod, _func))


def main() -> None:
    """Entry point of the ``kvroute`` console script."""
    app()
