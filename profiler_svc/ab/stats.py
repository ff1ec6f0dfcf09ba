"""Timing one step, and the statistics that turn interleaved rounds into a verdict."""
from __future__ import annotations

import time

import numpy as np
import torch

# the level lives with the interval, where the web reads it without torch
from ..intervals import CI_LEVEL, binomial_below, sign_test_rank


def timer_name(device: torch.device) -> str:
    return "cuda_events" if device.type == "cuda" else "perf_counter"


STEPS_PER_RUN = 3


def time_ms(fn, device: torch.device, steps: int = STEPS_PER_RUN) -> float:
    """Milliseconds per call of `fn()` in a loop: one untimed lead call, then `steps` calls back to back.

    As in a training loop, the host enqueues the next step while the GPU runs this one, so a step the GPU
    bounds is timed without the host's start-up that an isolated, synchronized step would add; this is the
    step that capture times and the analysis replays. CUDA events on a GPU, a wall clock elsewhere.
    """
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)  # nothing queued before the run is counted in it
        fn()
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps


def speedup_ci(a_ms, b_ms, level: float = CI_LEVEL) -> tuple[float, float, float, float]:
    """(median over rounds of A / B, CI low, CI high, the CI's level): the exact distribution-free interval for
    the median of the rounds' ratios (order statistics, the sign test's interval).

    Paired by round: A and B of one round ran side by side and share whatever the machine was doing then.
    A lent host's pace drifts over a minute (one process's plain loop step moved by up to 23%:
    benchmarks/results/predict_vs_ab.md, "Loop drift"), which moves both alike; each round's ratio cancels it,
    where a ratio of the two medians keeps it. The interval covers the true median ratio at least `level` of the
    time whatever the ratios' distribution; a percentile bootstrap of the median covered it less (a no-op came out
    faster or slower in 6-7% of simulated runs of 5 to 30 rounds, 47% at 2). Fewer than MIN_ROUNDS rounds cannot
    reach `level`: their interval is the whole range of the ratios, at the level it has (75% for 3 rounds), and
    `verdict` calls nothing faster or slower on it.
    """
    a, b = np.asarray(a_ms, dtype=float), np.asarray(b_ms, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError("need the same, non-zero number of A and B timings")
    ratios = np.sort(a / b)
    n = ratios.size
    k = sign_test_rank(n, level)
    if k == 0:
        k, level = 1, 1 - 2 * binomial_below(n, 1)
    return float(np.median(ratios)), float(ratios[k - 1]), float(ratios[n - k]), level


def saving_ms(a_ms, b_ms) -> float:
    """What B saves per step, A minus B, as the median over rounds of each round's difference (paired as
    speedup_ci is)."""
    return float(np.median(np.asarray(a_ms, dtype=float) - np.asarray(b_ms, dtype=float)))


def verdict(parity_passed: bool, ci_low: float | None, ci_high: float | None, ci_level: float = CI_LEVEL) -> str:
    """faster or slower only where an interval of CI_LEVEL excludes 1: one of fewer rounds claims nothing."""
    if not parity_passed:
        return "parity_failed"
    assert ci_low is not None and ci_high is not None  # timed whenever parity passed
    if ci_level < CI_LEVEL:
        return "no_difference"
    if ci_low > 1.0:
        return "faster"
    if ci_high < 1.0:
        return "slower"
    return "no_difference"
