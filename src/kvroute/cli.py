"""The ``kvroute`` command: each subcommand lives beside the code it drives."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="kvroute",
    help="Route LLM requests to the replica that holds their prefix, never behind a busy one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

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
    # A command may describe more than its flags (``serve``: every routing setting, from the registry).
    app.command(_name, epilog=getattr(_mod, f"{_func.upper()}_EPILOG", None))(getattr(_mod, _func))


def main() -> None:
    """Entry point of the ``kvroute`` console script."""
    app()
