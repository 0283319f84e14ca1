"""Sample startup logs: the doctor gives the right top finding and fix for each case the prefix-hashing
design hit."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.doctor.checks import diagnose
from kvroute.doctor.endpoint import facts_for_endpoint
from kvroute.doctor.finding import Severity, worst

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(("log", "code", "fix"), [
    ("hybrid_caching_off.log", "prefix-caching-off-hybrid",
     "--enable-prefix-caching --mamba-cache-mode align"),
    ("hybrid_mode_none.log", "mamba-mode-none", "--mamba-cache-mode align"),
    ("hybrid_align_block1600.log", "match-unit-coarse", "--prefix-match-unit 32"),
    ("hybrid_no_fp8_mamba_error.log", "mamba-blocks-below-max-num-seqs", "--max-num-seqs 127"),
    ("hybrid_align_mtp.log", "hybrid-cache-with-spec-decode", "kvroute canary"),
    ("docker_compose_prefix.log", "startup-error", "read the log lines"),
])
def test_top_finding_and_fix(log: str, code: str, fix: str) -> None:
    merged, _ = facts_for_endpoint(None, (FIXTURES / log).read_text())
    findings = diagnose(merged)
    top = findings[0]
    assert (top.code, worst(findings)) == (code, top.severity)
    assert top.fix is not None and top.fix.startswith(fix)


@pytest.mark.parametrize("log", ["hybrid_align_unit32.log", "dense_caching_on.log"])
def test_healthy_configurations_have_no_warning(log: str) -> None:
    merged, _ = facts_for_endpoint(None, (FIXTURES / log).read_text())
    assert worst(diagnose(merged)).rank < Severity.WARNING.rank
