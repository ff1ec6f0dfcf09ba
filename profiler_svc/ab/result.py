"""What an A/B test found: parity per tensor, timing with its confidence interval, peak memory."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..kernels.parity import TensorParity, worst

SCHEMA = "profiler_svc.ab/1"


@dataclass
class Timing:
    timer: str  # "cuda_events" or "perf_counter"
    rounds: int
    warmup: int
    a_ms: list  # one per round, in order
    b_ms: list
    median_a_ms: float
    median_b_ms: float
    speedup: float  # median A / median B: above 1 means B is faster
    ci_low: float
    ci_high: float
    ci_level: float


@dataclass
class ABResult:
    swaps: list  # swap names asked for
    train: bool
    device: str  # "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)"
    verdict: str  # faster | slower | no_difference | parity_failed
    swapped: list  # [{"module", "class", "swap"}] instances B replaced
    skipped: list  # [{"module", "swap", "reason"}] instances a swap matched but could not replace
    parity_passed: bool
    parity_factor: float
    parity: list = field(default_factory=list)  # TensorParity per compared tensor
    timing: Timing | None = None  # None when parity failed (a wrong kernel's speed means nothing)
    peak_memory_a_bytes: int | None = None
    peak_memory_b_bytes: int | None = None
    memory_method: str | None = None  # "torch.cuda.max_memory_allocated"; None on CPU (not measured)

    def to_dict(self) -> dict:
        """JSON-serializable (non-finite numbers become null): the form the CLI and storage use."""
        return _finite({"schema": SCHEMA, **asdict(self)})

    def summary(self) -> str:
        """A few lines for a terminal."""
        kind = "training step (forward + backward)" if self.train else "inference (forward, no grad)"
        counts = {}
        for row in self.swapped:
            counts[row["swap"]] = counts.get(row["swap"], 0) + 1
        lines = [
            f"A/B of {', '.join(self.swaps)} on {self.device}: {kind}",
            "swapped: " + ", ".join(f"{name} x{n}" for name, n in counts.items())
            + (f" ({len(self.skipped)} matched instances not swapped)" if self.skipped else ""),
        ]
        bad = [t for t in self.parity if not t.passed]
        w = worst(self.parity)
        if w is not None:
            detail = (f"{w.name}: B max abs err {w.b_max_abs:.3g}, A (eager) {w.a_max_abs:.3g}, "
                      f"allowed {w.allowed_abs:.3g}")
            status = "passed" if self.parity_passed else f"FAILED on {len(bad)} of {len(self.parity)} tensors"
            lines.append(f"parity vs fp64: {status} (B within {self.parity_factor:g}x of eager's error); "
                         f"worst {detail}")
        if self.timing:
            t = self.timing
            lines.append(f"time: A {t.median_a_ms:.3f} ms, B {t.median_b_ms:.3f} ms "
                         f"(medians of {t.rounds} interleaved rounds after {t.warmup} warm-up, {t.timer})")
            lines.append(f"speedup A/B: {t.speedup:.3f}x ({t.ci_level:.0%} CI {t.ci_low:.3f}-{t.ci_high:.3f})")
        if self.memory_method:
            lines.append(f"peak memory: A {_gb(self.peak_memory_a_bytes)}, B {_gb(self.peak_memory_b_bytes)} "
                         f"({self.memory_method})")
        else:
            lines.append("peak memory: not measured on CPU")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _gb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f} GB"


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(value) for value in obj]
    return obj


__all__ = ["ABResult", "Timing", "TensorParity", "SCHEMA"]
