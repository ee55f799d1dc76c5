"""Two-sample chi-square test of homogeneity, for the sampled-distribution checks of speculative decoding.

Shared by tests/test_speculative.py and scripts/check_speculative.py (which puts tests/ on its path)."""

from __future__ import annotations

import math
from collections import Counter


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (categories with < 5 expected pooled); the p-value."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    na, nb = sum(a.values()), sum(b.values())
    rows, rest = [], [0, 0]
    for k in keys:
        if (a[k] + b[k]) * min(na, nb) / (na + nb) >= 5:
            rows.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest):
        rows.append(tuple(rest))
    if len(rows) < 2:
        return 1.0
    x2 = 0.0
    for ca, cb in rows:
        tot = ca + cb
        for c, n in ((ca, na), (cb, nb)):
            e = tot * n / (na + nb)
            x2 += (c - e) ** 2 / e
    return chi2_sf(x2, len(rows) - 1)


def chi2_sf(x: float, k: int) -> float:
    """Upper tail of the chi-square distribution (regularised gamma Q(k/2, x/2), by its series)."""
    s, z = k / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / s
    n = 1
    while term > 1e-12 * total and n < 1000:
        term *= z / (s + n)
        total += term
        n += 1
    p_lower = math.exp(-z + s * math.log(z) - math.lgamma(s)) * total
    return max(0.0, 1.0 - p_lower)
