"""What an A/B test found: parity per tensor, numeric cost, timing with its confidence interval, peak memory,
and the analyser's prediction beside the measured change."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..formats import reference_note
from ..kernels.parity import ILL_CONDITIONED, TensorParity, worst
from ..intervals import CI_LEVEL, MIN_ROUNDS

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
    speedup: float  # median over rounds of A / B: above 1 means B is faster
    ci_low: float
    ci_high: float
    ci_level: float
    saving_ms: float | None = None  # median over rounds of A - B (ms per step); None in results stored before it


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
    fixes: list = field(default_factory=list)  # fix names asked for
    fixes_applied: list = field(default_factory=list)  # [{"fix", "note"}] what each did to this model
    fixes_skipped: list = field(default_factory=list)  # [{"fix", "reason"}] fixes that do not apply here
    max_rel_error: float | None = None  # the user's tolerance for a precision change (normwise, per tensor)
    numeric_cost: dict | None = None  # a precision change's worst error vs fp64, beside eager's
    reference_fallbacks: list = field(default_factory=list)  # ops the fp64 reference ran in lower precision
    prediction: dict | None = None  # the analyser's predicted step change, beside the measured one

    def to_dict(self) -> dict:
        """JSON-serializable (non-finite numbers become null): the form the CLI and storage use."""
        return _finite({"schema": SCHEMA, **asdict(self)})

    def summary(self) -> str:
        """A few lines for a terminal."""
        kind = "training step (forward + backward)" if self.train else "inference (forward, no grad)"
        counts: dict[str, int] = {}
        for row in self.swapped:
            counts[row["swap"]] = counts.get(row["swap"], 0) + 1
        lines = [f"A/B of {', '.join(self.swaps + self.fixes)} on {self.device}: {kind}"]
        if self.swaps:
            lines.append("swapped: " + (", ".join(f"{name} x{n}" for name, n in counts.items()) or "nothing")
                         + (f" ({len(self.skipped)} matched instances not swapped)" if self.skipped else ""))
        lines += [f"fix {row['fix']}: {row['note']}" for row in self.fixes_applied]
        lines += [f"fix {row['fix']}: not applied ({row['reason']})" for row in self.fixes_skipped]
        lines += [f"fp64 reference: {reference_note(row)}" for row in self.reference_fallbacks]
        cost = [t for t in self.parity if t.gate == "cost"]
        strict = [t for t in self.parity if t.gate == "strict"]
        noisy = [t for t in self.parity if t.gate == "ill_conditioned"]
        discrete = [t for t in self.parity if t.gate == "mismatch"]
        if cost:
            w = worst(cost)
            assert w is not None  # cost is not empty
            tolerance = "no tolerance set" if self.max_rel_error is None else f"tolerance {self.max_rel_error:g}"
            bad = [t for t in cost if not t.passed]
            status = "within" if not bad else f"OVER on {len(bad)} of {len(cost)} tensors:"
            lines.append(f"numeric cost vs fp64 (normwise relative error, {status} {tolerance}): worst {w.name} "
                         f"{w.b_rms_rel:.3g}, eager {w.a_rms_rel:.3g}")
        if strict:
            bad = [t for t in strict if not t.passed]
            w = worst(strict)
            assert w is not None  # strict is not empty
            against = "the precision fixes alone" if cost else "eager"
            status = "passed" if not bad else f"FAILED on {len(bad)} of {len(strict)} tensors"
            lines.append(f"parity vs fp64: {status} (B within {against}'s error + {self.parity_factor:g}x its spread); "
                         f"worst {w.name}: B normwise err {_g(w.b_rms_rel)}, baseline {_g(w.a_rms_rel)}, allowed "
                         f"{_g(w.allowed_rms_rel)}; max abs {w.b_max_abs:.3g}, allowed {w.allowed_abs:.3g}")
        if noisy:
            bad = [t for t in noisy if not t.passed]
            status = "within" if not bad else f"OVER on {len(bad)}:"
            lines.append(f"{len(noisy)} tensors eager itself gets wrong by >= {ILL_CONDITIONED:g} of their norm "
                         f"(ill-conditioned, not judged strictly): B {status} twice eager's error")
        if discrete:
            bad = [t for t in discrete if not t.passed]
            w = worst(discrete)
            assert w is not None  # discrete is not empty
            status = "within" if not bad else f"OVER on {len(bad)}:"
            lines.append(f"{len(discrete)} integer or bool tensors, judged by the share of elements that differ from "
                         f"fp64's: B {status} eager's share + {self.parity_factor:g}x its spread; worst {w.name}: "
                         f"B {_g(w.b_rms_rel)}, eager {_g(w.a_rms_rel)}, allowed {_g(w.allowed_rms_rel)}")
        if self.timing:
            t = self.timing
            lines.append(f"time: A {t.median_a_ms:.3f} ms, B {t.median_b_ms:.3f} ms "
                         f"(medians of {t.rounds} interleaved rounds after {t.warmup} warm-up, {t.timer})")
            lines.append(f"speedup A/B: {t.speedup:.3f}x ({t.ci_level:.0%} CI {t.ci_low:.3f}-{t.ci_high:.3f}; "
                         "each round's A/B, median)")
            if t.ci_level < CI_LEVEL:
                lines.append(f"{t.rounds} rounds give no {CI_LEVEL:.0%} interval (the fewest that do: {MIN_ROUNDS}): "
                             "no verdict on speed")
            if t.saving_ms is not None:
                lines.append(f"B saves {t.saving_ms:.3f} ms per step (each round's A - B, median)")
        if self.memory_method:
            lines.append(f"peak memory: A {_gb(self.peak_memory_a_bytes)}, B {_gb(self.peak_memory_b_bytes)} "
                         f"({self.memory_method})")
        else:
            lines.append("peak memory: not measured on CPU")
        p = self.prediction
        if p and p.get("saving_us_per_step") is not None:
            measured = p.get("measured_saving_us_per_step")
            bounds = _noted_range(p)
            spread = f" ({bounds[0] / 1e3:.3f} to {bounds[1] / 1e3:.3f} over the host's pace)" if bounds else ""
            if measured is not None:
                where = ("" if not bounds else ", inside that range" if bounds[0] <= measured <= bounds[1]
                         else ", outside that range")
                spread += f"; measured {measured / 1e3:.3f} ms{where}"
            lines.append(f"predicted saving {p['saving_us_per_step'] / 1e3:.3f} ms per step of "
                         f"{p.get('step_us', 0) / 1e3:.3f}{spread}")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _noted_range(prediction: dict) -> tuple[float, float] | None:
    """The predicted saving's range over the host's pace (µs), where the analysis noted it as wide."""
    bounds = prediction.get("saving_range_us")
    if prediction.get("pace_note") and isinstance(bounds, list) and len(bounds) == 2 \
            and all(isinstance(b, (int, float)) for b in bounds):
        return float(bounds[0]), float(bounds[1])
    return None


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


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
