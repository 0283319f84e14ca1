"""One diagnosis: what is wrong (or right), why we think so, and the exact fix."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Severity(StrEnum):
    """How much a finding matters, mildest first."""

    OK = "ok"  # checked and fine: worth saying, so a clean report is evidence rather than silence
    INFO = "info"  # a figure or a caveat the operator should know
    WARNING = "warning"  # the cache works worse than it could
    ERROR = "error"  # the cache cannot work, or the engine cannot start

    @property
    def rank(self) -> int:
        """Position in the order ok < info < warning < error."""
        return _ORDER.index(self)


_ORDER = (Severity.OK, Severity.INFO, Severity.WARNING, Severity.ERROR)


@dataclass(frozen=True, slots=True)
class Finding:
    """A diagnosis with the evidence behind it.

    ``code`` is stable (scripts match on it); ``fix`` is the exact flags or action, or None when
    there is nothing to change; ``evidence`` says where each fact came from (a metric label, a log
    line, a measurement) so the reader can check it.
    """

    severity: Severity
    code: str
    title: str
    detail: str
    fix: str | None = None
    evidence: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        """The JSON form used by ``--json``."""
        return {
            "severity": self.severity.value,
            "code": self.code,
            "title": self.title,
            "detail": self.detail,
            "fix": self.fix,
            "evidence": list(self.evidence),
        }


def worst(findings: Iterable[Finding]) -> Severity:
    """The most severe finding's severity (``ok`` for none)."""
    return max((f.severity for f in findings), key=lambda s: s.rank, default=Severity.OK)
