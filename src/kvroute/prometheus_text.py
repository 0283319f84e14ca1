"""Prometheus exposition text -> flat samples, and the few queries the checks need."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One line of the exposition: full sample name (with ``_total``/``_sum``), labels, value."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_exposition(text: str) -> list[Sample]:
    """Parse exposition text with prometheus-client's own parser."""
    try:
        return [
            Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not Prometheus exposition text: {exc}") from exc


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
