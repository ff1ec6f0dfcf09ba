"""Timing one step, and the statistics that turn interleaved rounds into a verdict."""
from __future__ import annotations

import time

import numpy as np
import torch

BOOTSTRAP_RESAMPLES = 10_000
CI_LEVEL = 0.95


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


def speedup_ci(a_ms, b_ms, seed: int, level: float = CI_LEVEL,
               resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """(median over rounds of A / B, CI low, CI high) by a percentile bootstrap over rounds.

    Paired by round: A and B of one round ran side by side and share whatever the machine was doing then.
    A lent host's pace drifts over a minute (one process's plain loop step moved by up to 23%:
    benchmarks/results/predict_vs_ab.md, "Loop drift"), which moves both alike; each round's ratio cancels it,
    where a ratio of the two medians keeps it.
    """
    a, b = np.asarray(a_ms, dtype=float), np.asarray(b_ms, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError("need the same, non-zero number of A and B timings")
    ratios = a / b
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(resamples, a.size))
    resampled = np.median(ratios[idx], axis=1)
    tail = (1.0 - level) / 2
    low, high = np.quantile(resampled, [tail, 1.0 - tail])
    return float(np.median(ratios)), float(low), float(high)


def saving_ms(a_ms, b_ms) -> float:
    """What B saves per step, A minus B, as the median over rounds of each round's difference (paired as
    speedup_ci is)."""
    return float(np.median(np.asarray(a_ms, dtype=float) - np.asarray(b_ms, dtype=float)))


def verdict(parity_passed: bool, ci_low: float | None, ci_high: float | None) -> str:
    if not parity_passed:
        return "parity_failed"
    assert ci_low is not None and ci_high is not None  # timed whenever parity passed
    if ci_low > 1.0:
        return "faster"
    if ci_high < 1.0:
        return "slower"
    return "no_difference"
