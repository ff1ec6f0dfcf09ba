"""The compare page's interval for B's steps against A's: the exact Mann-Whitney interval for the shift between two
independent samples, at the level it reaches (queries.step_difference, profiler_svc.intervals)."""
import itertools
import math

import numpy as np
import pytest

from profiler_svc.storage.queries import step_difference
from profiler_svc import intervals


def steps(values) -> dict:
    return {"step_us": {"values": [float(v) for v in values]}}


@pytest.mark.parametrize("n, m", [(3, 3), (3, 5), (4, 4), (5, 7), (8, 8), (10, 12), (20, 20), (50, 40)])
def test_steps_of_one_distribution_differ_at_most_5_percent_of_the_time(n, m):
    """Two runs whose steps come from one distribution (lognormal, 5% spread): the interval misses the true shift (0)
    at most 1 - its level of the time, and the page calls a difference (an interval of at least CI_LEVEL without 0)
    in at most 5%, plus three binomial standard deviations of noise."""
    rng = np.random.default_rng(1000 * n + m)
    tests = 4000
    misses = differs = 0
    level = None
    for _ in range(tests):
        d = step_difference(steps(1000 * np.exp(rng.normal(0, 0.05, n))), steps(1000 * np.exp(rng.normal(0, 0.05, m))))
        level = d["ci_level"]
        missed = d["ci_low_us"] > 0 or d["ci_high_us"] < 0
        misses += missed
        differs += missed and level >= intervals.CI_LEVEL

    def noise(p):
        return 3 * math.sqrt(p * (1 - p) / tests)

    assert misses / tests <= (1 - level) + noise(1 - level), (misses / tests, level)
    assert differs / tests <= (1 - intervals.CI_LEVEL) + noise(1 - intervals.CI_LEVEL), differs / tests


def test_3_and_3_steps_give_the_whole_range_at_its_exact_level():
    """3 and 3 steps cannot reach 95%: the interval is every difference's range, which misses the shift only when all
    of one run's steps are below all of the other's, 2 of the C(6, 3) = 20 orders equally likely under no shift."""
    a, b = [10.0, 12.0, 11.0], [15.0, 13.0, 14.5]
    d = step_difference(steps(a), steps(b))
    assert d["ci_level"] == pytest.approx(1 - 2 / math.comb(6, 3)) and d["ci_level"] < intervals.CI_LEVEL
    assert (d["ci_low_us"], d["ci_high_us"]) == (min(b) - max(a), max(b) - min(a))
    # the estimate is the interval's own quantity: the median of the 9 differences (Hodges-Lehmann)
    assert d["delta_us"] == float(np.median([y - x for x in a for y in b]))
    assert intervals.MIN_STEPS == 4 and intervals.shift_rank(4, 4) == (1, pytest.approx(1 - 2 / math.comb(8, 4)))


@pytest.mark.parametrize("n, m", [(1, 4), (2, 2), (3, 4), (4, 6), (5, 5), (6, 7)])
def test_the_level_is_counted_over_every_order_of_the_steps(n, m):
    """shift_rank's c and level against the Mann-Whitney distribution enumerated: U, the pairs with b below a, over
    every placement of A's steps among all the steps (each equally likely under no shift)."""
    counts = np.zeros(n * m + 1)
    for places in itertools.combinations(range(n + m), n):
        counts[sum(place - k for k, place in enumerate(places))] += 1
    below = np.cumsum(counts) / counts.sum()  # below[u] = P(U <= u)
    c, level = intervals.shift_rank(n, m)
    reaching = [k for k in range(1, n * m // 2 + 1) if 2 * below[k - 1] <= 1 - intervals.CI_LEVEL]
    assert c == max(reaching, default=1)
    assert level == pytest.approx(1 - 2 * below[c - 1])


def test_many_steps_use_the_normal_approximation_and_a_bounded_subset(monkeypatch):
    """Beyond EXACT_WORK the rank comes from the normal approximation, which agrees with the exact count there; a side
    of more than MAX_STEPS steps is a fixed subset of them, so the pairs stay bounded and the page the same."""
    exact = intervals.shift_rank(150, 160)
    monkeypatch.setattr(intervals, "EXACT_WORK", 0)
    intervals.shift_rank.cache_clear()
    try:
        c, level = intervals.shift_rank(150, 160)
    finally:
        intervals.shift_rank.cache_clear()
    assert abs(c - exact[0]) <= 1 and level == pytest.approx(exact[1], abs=1e-3) and level >= intervals.CI_LEVEL - 1e-3
    rng = np.random.default_rng(7)
    a, b = 1000 + rng.normal(0, 10, 50_000), 1005 + rng.normal(0, 10, 20_000)
    first, again = step_difference(steps(a), steps(b)), step_difference(steps(a), steps(b))
    assert first == again and first["a_steps"] == 50_000
    assert first["ci_low_us"] < 5 < first["ci_high_us"] and first["ci_level"] >= intervals.CI_LEVEL
    assert first["ci_low_us"] > 0  # a shift of half a standard deviation is clear at a thousand steps a side


def test_one_step_a_side_gives_no_interval_and_one_against_many_can_reach_its_level():
    d = step_difference(steps([10.0]), steps([11.0]))
    assert d["delta_us"] == 1.0 and d["ci_low_us"] is None and d["ci_level"] is None
    assert step_difference(steps([]), steps([1.0])) is None
    # one step against 40: the whole range misses the shift with chance 2/41 only, a 95.1% interval
    d = step_difference(steps([10.0]), steps([11.0 + i / 10 for i in range(40)]))
    assert d["ci_level"] == pytest.approx(1 - 2 / 41) and d["ci_level"] >= intervals.CI_LEVEL
    assert (d["ci_low_us"], d["ci_high_us"]) == (1.0, 4.9)


def test_the_estimate_agrees_with_its_interval_where_the_medians_do_not():
    """Steps of two kinds (an optimizer step every other step): B is 10 µs faster on every step but has one slow
    step more. The difference of the medians is +480 µs; the shift, and its interval, say faster."""
    jitter = np.linspace(-2, 2, 101)
    a = np.where(np.arange(101) < 51, 1000.0, 1500.0) + jitter
    b = np.where(np.arange(101) < 50, 990.0, 1490.0) + jitter
    d = step_difference(steps(a.tolist()), steps(b.tolist()))
    assert float(np.median(b) - np.median(a)) > 400
    assert d["ci_low_us"] <= d["delta_us"] <= d["ci_high_us"] < 0


def test_non_finite_step_times_are_left_out():
    d = step_difference(steps([10.0, float("nan"), 12.0, 11.0]), steps([13.0, float("inf"), 14.0, 15.0]))
    assert d["a_steps"] == d["b_steps"] == 3 and all(np.isfinite([d["delta_us"], d["ci_low_us"], d["ci_high_us"]]))
