"""The exact one-sided Clopper–Pearson bound and the rule of three."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.canary.binomial_bound import binomial_cdf, rule_of_three, upper_bound


def test_seed_sample_of_150_clean_replies_bounds_the_rate_below_two_percent() -> None:
    bound = upper_bound(0, 150)
    assert bound == pytest.approx(1 - 0.05 ** (1 / 150))
    assert bound == pytest.approx(0.019773, abs=1e-6)
    assert rule_of_three(150) == pytest.approx(0.02)


# Reference values: scipy.stats.beta.ppf(0.95, x + 1, n - x).
@pytest.mark.parametrize(("failures", "trials", "expected"), [
    (1, 150, 0.031233816921),
    (3, 150, 0.050877067979),
    (10, 1000, 0.016903175121),
    (5, 10, 0.777558898992),
    (1500, 3000, 0.515177302505),
])
def test_matches_the_beta_quantile(failures: int, trials: int, expected: float) -> None:
    assert upper_bound(failures, trials) == pytest.approx(expected, abs=1e-9)


def test_edges_and_bad_input() -> None:
    assert upper_bound(7, 7) == 1.0
    with pytest.raises(ValueError):
        upper_bound(0, 0)
    with pytest.raises(ValueError):
        upper_bound(5, 4)
    with pytest.raises(ValueError):
        upper_bound(1, 10, confidence=1.0)
    with pytest.raises(ValueError):
        rule_of_three(0)


@given(st.integers(min_value=1, max_value=400), st.data())
def test_bound_is_where_the_cdf_crosses_alpha(trials: int, data: st.DataObject) -> None:
    failures = data.draw(st.integers(min_value=0, max_value=trials - 1))
    bound = upper_bound(failures, trials)
    assert failures / trials < bound < 1.0
    assert math.isclose(binomial_cdf(failures, trials, bound), 0.05, abs_tol=1e-7)
    assert upper_bound(failures + 1, trials) > bound
    assert upper_bound(failures, trials + 1) < bound


def test_cdf_sums_to_one_and_survives_large_n() -> None:
    assert binomial_cdf(100_000, 100_000, 0.3) == pytest.approx(1.0)
    assert binomial_cdf(10, 100_000, 0.5) == pytest.approx(0.0, abs=1e-300)
    assert binomial_cdf(3, 10, 0.0) == 1.0
