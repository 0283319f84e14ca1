"""The command lines README.md shows, read from its code blocks, so that the tests that run them
cannot drift from what a reader copies."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


@dataclass(frozen=True)
class Command:
    """One README line as a shell reads it: leading ``NAME=VALUE`` assignments, then the argv."""

    line: str
    env: dict[str, str]
    argv: list[str]

    def option(self, name: str) -> str:
        """The value after ``name`` (the first time it appears); fails the caller if absent."""
        i = self.argv.index(name)
        return self.argv[i + 1]

    def replaced(self, name: str, value: str) -> list[str]:
        """The argv after the program (and subcommand), with ``name``'s value replaced."""
        argv = list(self.argv)
        argv[argv.index(name) + 1] = value
        return argv


def code_lines(readme: Path = README) -> list[str]:
    """Every line inside README.md's fenced code blocks."""
    lines, inside = [], False
    for line in readme.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside and line.strip():
            lines.append(line.strip())
    return lines


def commands(*program: str, having: str | None = None) -> list[Command]:
    """The README's lines that run ``program`` (e.g. ``"kvroute", "sim"``), comments dropped;
    ``having``: only lines with that option."""
    found = []
    for line in code_lines():
        words = shlex.split(line, comments=True)
        env: dict[str, str] = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words[:len(program)] == list(program) and (having is None or having in words):
            found.append(Command(line, env, words[len(program):]))
    return found


def command(*program: str, having: str | None = None) -> Command:
    """The one README line that runs ``program`` (with ``having``); fails when there is not exactly one."""
    found = commands(*program, having=having)
    assert len(found) == 1, f"README.md should show one `{' '.join(program)}` line" + (
        f" with {having}" if having else "") + f", found {[c.line for c in found]}"
    return found[0]
