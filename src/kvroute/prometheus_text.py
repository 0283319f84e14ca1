"""Prometheus exposition text -> flat samples: kvroute's one reader, and the queries built on it.

A hand-written single pass rather than ``prometheus_client.parser``: the fleet probe reads every
worker's ``/metrics`` each second on the router's event loop, and on a real vLLM exposition (60 kB,
650 lines) prometheus-client's parser took 26 ms against 1.7 ms for this one, which also skips the
lines whose name it was not asked for before splitting them.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One line of the exposition: full sample name (with ``_total``/``_sum``), labels, value."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_labels(labels: str) -> dict[str, str]:
    """Parse the inside of ``{a="1",b="x"}`` into a dict, undoing Prometheus escapes."""
    return {
        k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        for k, v in _LABEL.findall(labels)
    }


def _split(line: str) -> tuple[str, str, float] | None:
    """Split ``name{labels} value [timestamp]`` into name, label text and value; None if unreadable."""
    space = line.find(" ")
    brace = line.find("{")
    if brace != -1 and (space == -1 or brace < space):
        close = line.rfind("}")
        if close < brace:
            return None
        name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
    elif space != -1:
        name, labels, rest = line[:space], "", line[space:]
    else:
        return None
    parts = rest.split()
    if not name or not parts:
        return None
    try:
        return name, labels, float(parts[0])
    except ValueError:
        return None


def parse_exposition(text: str, names: Collection[str] | None = None, *,
                     skip_unreadable: bool = False) -> list[Sample]:
    """Every sample of ``text`` (only those called one of ``names`` when given), in order.

    A line that is neither blank, a comment nor a sample raises ``MetricsParseError``, unless
    ``skip_unreadable`` (the probe's choice: one bad line must not hide a worker's load).
    """
    wanted = None if names is None else frozenset(names)
    starts = None if wanted is None else tuple(wanted)
    samples: list[Sample] = []
    for number, line in enumerate(text.splitlines(), 1):
        if starts is not None and not line.startswith(starts):
            continue
        if not line.strip() or line.startswith("#"):
            continue
        split = _split(line)
        if split is None:
            if skip_unreadable:
                continue
            raise MetricsParseError(f"not Prometheus exposition text: line {number}: {line[:80]!r}")
        name, labels, value = split
        if wanted is not None and name not in wanted:
            continue
        samples.append(Sample(name, parse_labels(labels) if labels else {}, value))
    return samples


def total(samples: list[Sample], name: str) -> float | None:
    """Sum of every sample called ``name`` (across engines, models, label sets); None if absent."""
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None


def first_total(samples: list[Sample], names: tuple[str, ...]) -> tuple[str, float] | None:
    """The first of ``names`` present, with its total (vLLM renamed several counters)."""
    for name in names:
        value = total(samples, name)
        if value is not None:
            return name, value
    return None


def label_values(samples: list[Sample], label: str) -> list[str]:
    """Distinct values of ``label`` in order of first appearance."""
    seen: dict[str, None] = {}
    for s in samples:
        if label in s.labels:
            seen.setdefault(s.labels[label], None)
    return list(seen)


def where(samples: list[Sample], label: str, value: str) -> list[Sample]:
    """The samples whose ``label`` equals ``value``."""
    return [s for s in samples if s.labels.get(label) == value]
