"""Chi-square helpers for the speculative-decoding tests (no scipy in the test deps)."""

from __future__ import annotations

import math
from collections import Counter

Z_0001 = 3.0902  # the standard normal's upper 0.1% point: tests fail at significance 0.001


def chi2_critical(df: int, z: float = Z_0001) -> float:
    """The chi-square critical value (Wilson-Hilferty approximation, good to ~1% for df>=2)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def goodness_of_fit(draws: list[int], probs: dict[int, float], min_expected: float = 5.0):
    """(statistic, df) of draws against probs, cells with expected < min_expected pooled.
    A draw outside probs' support is an immediate failure (statistic inf)."""
    n = len(draws)
    counts = Counter(draws)
    if any(probs.get(t, 0.0) <= 0.0 for t in counts):
        return math.inf, 1
    cells, rest_obs, rest_exp = [], 0, 0.0
    for t, p in probs.items():
        if p * n >= min_expected:
            cells.append((counts.get(t, 0), p * n))
        else:
            rest_obs += counts.get(t, 0)
            rest_exp += p * n
    if rest_exp > 0:
        cells.append((rest_obs, rest_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, max(len(cells) - 1, 1)


def two_sample(a: list[int], b: list[int], min_count: int = 10):
    """(statistic, df) of the 2 x K contingency test that a and b share one distribution;
    categories with fewer than min_count draws in both together are pooled."""
    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda t: -(ca[t] + cb[t]))
    rows, pool_a, pool_b = [], 0, 0
    for t in keys:
        if ca[t] + cb[t] >= min_count:
            rows.append((ca[t], cb[t]))
        else:
            pool_a += ca[t]
            pool_b += cb[t]
    if pool_a + pool_b:
        rows.append((pool_a, pool_b))
    na, nb = len(a), len(b)
    stat = 0.0
    for oa, ob in rows:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return stat, max(len(rows) - 1, 1)
