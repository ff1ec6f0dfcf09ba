"""Distribution-free confidence intervals for step times, exact at small samples: the A/B's paired rounds (the sign
test's interval for the median of the rounds' ratios) and two runs' steps on the compare page (the Mann-Whitney
interval for the shift between them). Imports neither torch nor the database: the A/B, storage and the web read it.
"""
from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

# The level a verdict needs (faster, slower, differs); an interval of fewer rounds or steps has a lower one and
# claims nothing.
CI_LEVEL = 0.95


def binomial_below(n: int, k: int) -> float:
    """P(fewer than k of n ratios fall below their median): Binomial(n, 1/2)'s CDF at k - 1."""
    return sum(math.comb(n, i) for i in range(k)) / 2 ** n


def sign_test_rank(n: int, level: float) -> int:
    """The largest k whose interval [k-th smallest, k-th largest] of n ratios misses their median with
    probability 2 * P(Binomial(n, 1/2) < k) <= 1 - level; 0 when even the whole range misses it more often."""
    k = 0
    while k + 1 <= (n + 1) // 2 and 2 * binomial_below(n, k + 1) <= 1 - level:
        k += 1
    return k


# The fewest A/B rounds whose interval reaches CI_LEVEL (6 for 95%: the whole range of 6 ratios covers 1 - 2 / 2**6).
MIN_ROUNDS = next(n for n in range(1, 100) if sign_test_rank(n, CI_LEVEL))

# Steps a side the shift's interval uses at most, a fixed random subset beyond: at most a million pairwise differences.
MAX_STEPS = 1000
# The Mann-Whitney distribution is counted exactly while that takes at most this many array element updates
# (min(n, m)**2 * max(n, m)); beyond, where both sides have some two hundred steps or more, its normal approximation.
EXACT_WORK = 10_000_000
# Slack for float round-off where a tail probability meets 1 - level exactly.
_EPS = 1e-12


def _mann_whitney_cdf(n: int, m: int) -> np.ndarray:
    """P(U <= u) for u = 0 .. n*m // 2, U the Mann-Whitney count of pairs (a_i, b_j) with b_j < a_i when A's n and
    B's m values come from one continuous distribution. U's generating function is the Gaussian binomial
    [n+m choose n]_q / C(n+m, n) = prod over i = 1..n of (1 - q**(m+i)) / (1 - q**i) * i / (m+i), truncated."""
    n, m = min(n, m), max(n, m)
    top = n * m // 2
    p = np.zeros(top + 1)
    p[0] = 1.0
    for i in range(1, n + 1):
        if m + i <= top:  # times (1 - q**(m+i))
            p[m + i:] -= p[:top + 1 - (m + i)].copy()
        # over (1 - q**i): p[u] += p[u - i] + p[u - 2i] + ..., a cumulative sum along each stride of i
        padded = np.zeros(-(-(top + 1) // i) * i)
        padded[:top + 1] = p
        p = padded.reshape(-1, i).cumsum(axis=0).ravel()[:top + 1] * (i / (m + i))
    return np.cumsum(p)


@lru_cache(maxsize=256)
def shift_rank(n: int, m: int, level: float = CI_LEVEL) -> tuple[int, float]:
    """(c, its level): the largest c whose interval [c-th smallest, c-th largest] of the n*m differences b_j - a_i
    misses the true shift with probability 2 * P(U < c) <= 1 - level, and that interval's level 1 - 2 * P(U < c);
    where none reaches `level` (too few values), c = 1, the whole range, at the level it has."""
    alpha = 1 - level
    if min(n, m) ** 2 * max(n, m) <= EXACT_WORK:
        cdf = _mann_whitney_cdf(n, m)
        c = int(np.searchsorted(2 * cdf, alpha + _EPS, side="right"))  # cdf[c - 1] is P(U < c)
        return max(c, 1), 1 - 2 * float(cdf[max(c, 1) - 1])
    # normal approximation with continuity correction: P(U < c) = P(U <= c - 1) ~ Phi((c - 1/2 - mean) / sd)
    mean, sd = n * m / 2, math.sqrt(n * m * (n + m + 1) / 12)
    normal = NormalDist()
    c = max(1, math.floor(mean + 0.5 + sd * normal.inv_cdf(alpha / 2)))
    return c, 1 - 2 * normal.cdf((c - 0.5 - mean) / sd)


def shift_interval(a, b, level: float = CI_LEVEL) -> tuple[float, float, float, float]:
    """(estimate, low, high, its level) for the shift of B's values from A's (B - A, two independent samples): the
    Hodges-Lehmann estimate, the median of the differences b_j - a_i over all pairs, and the exact distribution-free
    interval around it, their c-th smallest to c-th largest (shift_rank). The interval covers the true shift at least
    `level` of the time whatever the distribution, where the two differ by a shift; with too few values, it is the
    whole range at the level it has. A side of more than MAX_STEPS values is a fixed random subset of them (still an
    exact interval, a little wider)."""
    rng = np.random.default_rng(0)
    a, b = (np.asarray(x, dtype=float) for x in (a, b))
    a, b = (rng.choice(x, MAX_STEPS, replace=False) if x.size > MAX_STEPS else x for x in (a, b))
    if not a.size or not b.size:
        raise ValueError("need values on both sides")
    c, achieved = shift_rank(a.size, b.size, level)
    differences = np.subtract.outer(b, a).ravel()
    last = differences.size - c
    ordered = np.partition(differences, [c - 1, last])
    return float(np.median(differences)), float(ordered[c - 1]), float(ordered[last]), achieved


# The fewest steps a side whose shift interval reaches CI_LEVEL (4: the whole range of 4 and 4 covers 1 - 2 / C(8, 4)).
MIN_STEPS = next(n for n in range(1, 100) if shift_rank(n, n)[1] >= CI_LEVEL)
