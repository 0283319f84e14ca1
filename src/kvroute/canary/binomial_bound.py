"""How high could the failure rate be, given what a sample showed?

The exact one-sided Clopper–Pearson upper bound: the largest rate ``p`` at which seeing ``x`` or
fewer failures in ``n`` trials still has probability at least ``1 - confidence``.  With no failures
it is ``1 - (1 - confidence)^(1/n)``, which the rule of three approximates as ``3/n`` (150 clean
replies bound the rate below ~2%).
"""

from __future__ import annotations

import math

_ITERATIONS = 200


def upper_bound(failures: int, trials: int, confidence: float = 0.95) -> float:
    """Exact one-sided upper confidence bound on the failure rate."""
    if trials <= 0:
        raise ValueError("trials must be positive")
    if not 0 <= failures <= trials:
        raise ValueError("failures must be between 0 and trials")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
    alpha = 1.0 - confidence
    if failures == trials:
        return 1.0
    if failures == 0:
        return 1.0 - float(alpha ** (1.0 / trials))
    # binomial_cdf falls as p rises: bisect for the p where it crosses alpha.
    lo, hi = failures / trials, 1.0
    for _ in range(_ITERATIONS):
        mid = (lo + hi) / 2
        if binomial_cdf(failures, trials, mid) > alpha:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return hi


def rule_of_three(trials: int) -> float:
    """``3/n``: the familiar approximation of the 95% bound when nothing failed."""
    if trials <= 0:
        raise ValueError("trials must be positive")
    return min(1.0, 3.0 / trials)


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space so large ``n`` does not underflow."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n = math.lgamma(n + 1)
    logs = [log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
            for i in range(k + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * math.fsum(math.exp(v - top) for v in logs))
