"""One trace's analysis: its steps and what bounds them, and what each finding's fix buys per step.

Every saving comes from the what-if replay (trace.replay): the replayed steps with the fix, against the
replayed steps without it. Fixes are priced one at a time for each finding, and all together for the
report's one combined prediction. A kernel's time belongs to at most one finding: where two findings'
fixes touch the same kernels, the more specific root cause keeps them.
"""
import re
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..detectors import Finding, run_detectors
from ..detectors.common import (VOCAB_MIN, Recommendation, fmt_us, is_communication, is_compute_bound_kernel,
                                name_mask, size_root_cause)
from ..detectors.data_parallel import DATA_PARALLEL_KEY
from ..detectors.launch_gaps import idle_breakdown
from ..detectors.misalignment import HEAD_DIM_KEY
from ..detectors.unfused import PATTERNS
from ..trace.model import Trace
from ..trace.replay import GPU_BOUND_SLACK, Change, HostCost, Timeline, calibrate, sensitivity, time_covered_by

# Which finding keeps a kernel two fixes both change: the specific root cause first, generic fusion last.
_CLAIM_ORDER = ("fallback_kernel", "misalignment", "unfused_chain", "host_sync", "launch_gaps")
# A decode loop reads at least this many tokens per step.
_MIN_DECODE_TOKENS = 4
# The step is bound by the host (or the GPU) when halving its time shortens the step this much more than
# halving the other's does.
_BOUND_MARGIN = 0.15
# Capture's timed unprofiled steps further apart than this (slowest / fastest - 1) get a note: its median is then
# one moment's pace (on the H100 a plain loop's step moved by up to 23% within a minute; predict_vs_ab.md).
UNSTEADY_SPREAD = 0.2
# An SM clock at or below this share of its maximum, with the power cap among the reasons, is the cap at work
# (at 1972 of 1980 MHz NVML may still name the cap)
POWER_CAPPED_CLOCK = 0.98
_GPU_FIGURE_MAX = 1e5  # MHz, W or readings above this are not a GPU's: junk in the metadata
_METADATA_MAX = 86400e6  # capture's figures: µs of a day at most (the loader's longest event), MHz and W far less
# capture's unprofiled step against the trace's profiled one: the profiler slows a step, by up to several times where
# the host bounds it, and never makes it this much faster; outside these, the figure is not this trace's step
UNPROFILED_RATIO_MAX = 50.0
UNPROFILED_SLOWER_MAX = 2.0
# The most profiler cost per recorded event a calibration may take off: 0-20 µs in every captured trace (H100, H200;
# record_shapes and labels), so beyond this the profiled step's extra time is not the profiler's.
PROFILER_US_PER_EVENT_MAX = 100.0
# Host time multipliers the prediction is also replayed at: how far from capture's calibration the host's pace was
# when the A/B ran, 10th to 90th percentile over the committed runs, rounded (benchmarks/results/host_pace_drift_*.json)
HOST_PACE_RANGE = (0.85, 1.45)
# The prediction names its range where the saving moves across HOST_PACE_RANGE by over this share of it and by over
# PACE_NOTE_STEP of the step
PACE_NOTE_SHARE = 0.25
PACE_NOTE_STEP = 0.01
# why a fix priced by its floor (Finding.step_floor_us) is not in the combined prediction
UNREPLAYED = "the replay cannot model this fix; its saving is an upper bound"


@dataclass
class Analysis:
    trace: Trace
    findings: list
    steps: dict
    prediction: dict
    host: HostCost = HostCost()

    def predict(self, findings: list, host: Optional[HostCost] = None) -> dict:
        """The replayed step with these findings' fixes applied together (one replay, never a sum), each with its
        whole change: a kernel another finding claimed for the report still changes when only this fix is applied.
        HOST: another host than the calibrated one (a diagnostic's)."""
        if not self.trace.has_gpu:
            return {}
        host = host or self.host
        change = Change.union([f.whole_change or f.change for f in findings])
        timeline = self.trace.timeline
        before = timeline.replay(host=host).loop_step_us
        after = timeline.replay(change, host=host).loop_step_us
        return {"step_us": round(before, 2), "step_us_after": round(after, 2),
                "saving_us_per_step": round(before - after, 2),
                **pace_range(_replayed_steps(timeline, change, host), before - after, before, change.empty),
                "findings": [f.key for f in findings]}


_ON_TOP_NOTE = re.compile(r" Alone it leaves the step as it is; on top of the other recommended fixes it saves "
                          r"[^,]* per step, which the combined prediction counts\.")


def on_top(findings: list, step_us: float, step_with) -> tuple[list, list, float]:
    """The findings that alone leave the step as it is but shorten it once the combined fixes are in (GPU time freed
    in a step the host bounds counts when the other fixes take the host's work off: a padded vocabulary, then
    graphs), most GPU time first, each kept where the step with it (STEP_WITH(those kept and it)) is shorter: (the
    findings added, their waterfall entries, the step after them)."""
    added: list = []
    entries = []
    for f in sorted((f for f in findings if f.saving_us_per_step <= 0 and not f.recommendation.slows_step
                     and not f.change.empty), key=lambda f: -f.gpu_time_saved_us_per_step):
        after_us = step_with(added + [f])
        if after_us < step_us - 0.01:  # more than rounding
            added.append(f)
            entries.append({"finding": f.key, "title": f.title, "saving_us_per_step": round(step_us - after_us, 2),
                            "step_us_after": round(after_us, 2), "on_top": True})
            # once: a job's combined prediction comes after its ranks' own, and its figure is the one that stands
            f.detail = _ON_TOP_NOTE.sub("", f.detail) + (
                f" Alone it leaves the step as it is; on top of the other recommended fixes it saves "
                f"{fmt_us(step_us - after_us)} per step, which the combined prediction counts.")
            step_us = after_us
    return added, entries, step_us


def _replayed_steps(timeline: Timeline, change: Change, host: HostCost):
    """pace -> the step before and after CHANGE with the host's work taking PACE times its calibrated time."""
    return lambda pace: (timeline.replay(host=host.paced(pace)).loop_step_us,
                         timeline.replay(change, host=host.paced(pace)).loop_step_us)


def pace_range(steps_at, saving_us: float, step_us: float, empty: bool = False) -> dict:
    """{"saving_range_us": [low, high]}: the lowest and highest of a change's savings per step at the calibrated
    host pace (SAVING_US of STEP_US) and at each end of HOST_PACE_RANGE (STEPS_AT(pace): the step before and after
    it; three replayed paces: a saving need not move one way between them); with a "pace_note" where they are far
    apart, which names the step each is of (a slower host's step is longer, and so is its saving)."""
    paced = [(step_us, step_us - saving_us)] + [steps_at(pace) for pace in (() if empty else HOST_PACE_RANGE)]
    savings = [before - after for before, after in paced]
    low, high = int(np.argmin(savings)), int(np.argmax(savings))
    out: dict = {"saving_range_us": [round(savings[low], 2), round(savings[high], 2)],
                 "step_range_us": [round(paced[low][0], 2), round(paced[high][0], 2)]}  # the steps they are of
    if savings[high] - savings[low] > max(PACE_NOTE_SHARE * abs(saving_us), PACE_NOTE_STEP * step_us):
        faster, slower = 1 - HOST_PACE_RANGE[0], HOST_PACE_RANGE[1] - 1
        out["pace_note"] = (f"{fmt_us(savings[low])} saved of a {fmt_us(paced[low][0])} step to "
                            f"{fmt_us(savings[high])} of {fmt_us(paced[high][0])}, replayed with the host's work "
                            f"taking {faster:.0%} less, as much and {slower:.0%} more time than at capture (the span "
                            "of most captures' pace against their A/B's)")
    return out


def slows_step(f: Finding, slower_us: float, on_top: bool = False) -> Recommendation:
    """The finding's fix still applies (Report.predict can price it) but is not recommended: the replay says
    the step gets slower, alone or on top of the report's other fixes. A swap's host time per call costs more
    than the kernels it fuses save here, so its advice becomes keeping the eager code."""
    rec = f.recommendation
    if not rec.swap:
        return replace(rec, slows_step=True, summary=(
            f"Not with the other recommended fixes: on top of them this is predicted to make the step "
            f"{fmt_us(slower_us)} slower, so the combined prediction leaves it out. Alone: {rec.summary}"))
    where = " on top of the other recommended fixes" if on_top else ""
    return replace(rec, slows_step=True, summary=(
        f"Keep the eager code: the bundled `{rec.swap}` swap applies but is predicted to make the step "
        f"{fmt_us(slower_us)} slower{where}, its host time per call costing more than the fused kernels save "
        f"at this size. torch.compile fuses the chain without that cost."), snippet=PATTERNS["generic"].snippet)


def analyse(trace: Trace) -> Analysis:
    findings = run_detectors(trace)
    if not trace.has_gpu:
        return Analysis(trace, findings, _steps_without_gpu(trace), {})
    findings = _resolve_claims(_merge_root_causes(findings), trace.column("kernels", "dur"))
    timeline = trace.timeline
    host, calibration = _calibration(trace, timeline)
    base = timeline.replay(host=host)
    step_us = base.loop_step_us
    for f in findings:
        if f.step_floor_us is not None:
            f.saving_us_per_step = max(0.0, step_us - f.step_floor_us)
            f.evidence["step_floor_us"] = round(f.step_floor_us, 2)  # stored findings (the dashboard) read it there
            continue
        f.saving_us_per_step = step_us - timeline.replay(f.change, host=host).loop_step_us
        f.gpu_time_saved_us_per_step = _gpu_time_saved(trace, f.change)
        if f.recommendation.swap and f.saving_us_per_step < 0:
            f.recommendation = slows_step(f, -f.saving_us_per_step)
    helpful = sorted((f for f in findings if f.saving_us_per_step > 0 and f.step_floor_us is None),
                     key=lambda f: -f.saving_us_per_step)
    # the waterfall: the fixes applied one after another, largest first; each bar is what that fix buys on
    # top of the ones before it, and the last step is the combined prediction. A fix that lengthens the step
    # on top of those (its host cost outweighing a GPU saving the others already took) stays out of it.
    combined, waterfall, not_combined, step = Change(), [], [], step_us
    for f in helpful:
        after_us = timeline.replay(combined.merged(f.change), host=host).loop_step_us
        if after_us > step + 0.01:  # more than rounding
            not_combined.append({"finding": f.key, "title": f.title, "saving_us_per_step": round(step - after_us, 2)})
            f.recommendation = slows_step(f, after_us - step, on_top=True)
            continue
        combined = combined.merged(f.change)
        waterfall.append({"finding": f.key, "title": f.title, "saving_us_per_step": round(step - after_us, 2),
                          "step_us_after": round(after_us, 2)})
        step = after_us
    added, entries, step = on_top(findings, step, lambda more: timeline.replay(
        Change.union([combined] + [f.change for f in more]), host=host).loop_step_us)
    combined = Change.union([combined] + [f.change for f in added])
    waterfall += entries
    prediction = {
        "step_us": round(step_us, 2),
        "step_us_after": round(step, 2),
        "saving_us_per_step": round(step_us - step, 2),
        "saving_pct": round(100 * (1 - step / step_us), 2) if step_us else 0.0,
        **pace_range(_replayed_steps(timeline, combined, host), step_us - step, step_us, combined.empty),
        "findings": [w["finding"] for w in waterfall],
        "waterfall": waterfall,
        "not_combined": not_combined,
    }
    unreplayed = [f for f in findings if f.step_floor_us is not None]
    if unreplayed:
        prediction["left_out"] = [{"title": f.title, "why": UNREPLAYED} for f in unreplayed]
    return Analysis(trace, findings, _steps_summary(trace, timeline, base, host, calibration, findings), prediction,
                    host)


# -- one finding per root cause ------------------------------------------------------------------------

def _merge_root_causes(findings: list) -> list:
    """Findings that share a root cause (one misaligned size behind low-alignment GEMMs, a misaligned head
    and GEMMs on normal kernels) become one: its fix is all of theirs."""
    # a size behind an attention head_dim (hidden 1020 = 12 heads x head_dim 85) is that head_dim's symptom; other
    # findings' sizes are no root of another's (a 3-class head's N = 3 divides half the sizes there are)
    roots = {size for f in findings if len(f.root_cause) > 2 and f.key.startswith(HEAD_DIM_KEY)
             for size in f.root_cause[2]}
    own = {id(f): f.root_cause[:1] for f in findings}
    for f in findings:
        if len(f.root_cause) > 2:
            f.root_cause = size_root_cause(f.root_cause[2], roots)
    groups: dict = {}
    for f in findings:
        if f.root_cause:
            groups.setdefault(f.root_cause[0], []).append(f)
    out = [f for f in findings if not f.root_cause or len(groups[f.root_cause[0]]) == 1]
    for key, parts in groups.items():
        if len(parts) == 1:
            continue
        base = max(parts, key=lambda f: f.evidence.get("time_us") or 0.0)
        # the advice is the cause's own where one part is it (pad head_dim, not the hidden size it multiplies)
        causes = [p for p in parts if own[id(p)] == (key,)]
        cause = next((p for p in causes if p.key.startswith(HEAD_DIM_KEY)), causes[0] if causes else base)
        change = Change()
        for part in parts:
            change = change.merged(part.change)
        recommendation = cause.recommendation
        vocab = sorted({(m["size"], m["padded"]) for p in parts if isinstance(p.evidence.get("misaligned"), dict)
                        for m in p.evidence["misaligned"].values() if m["size"] >= VOCAB_MIN})
        if vocab and cause is not base:  # a symptom's vocabulary is a cause of its own, which the cause's advice omits
            recommendation = replace(recommendation, summary=recommendation.summary + " Also pad the vocabulary "
                                     + ", ".join(f"{v} → {p}" for v, p in vocab) + " (resize the embedding and head).")
        out.append(Finding(
            category="misalignment", title=f"{parts[0].root_cause[1]} ({len(parts)} symptoms)",
            detail=" ".join(f"({i}) {p.title}: {p.detail}" for i, p in enumerate(parts, 1)),
            evidence={**base.evidence, "symptoms": [{"title": p.title, "key": p.key, "evidence": p.evidence}
                                                    for p in parts]},
            recommendation=recommendation, change=change, key=f"misalignment:{key}",
            root_cause=base.root_cause))
    return out


# -- claims --------------------------------------------------------------------------------------------

def _resolve_claims(findings: list, kernel_dur: np.ndarray) -> list:
    """Each kernel to one finding: the earlier in _CLAIM_ORDER keeps it. A finding whose every kernel is
    already claimed goes, and the finding that claimed them names it as related (its advice stays in view)."""
    order = {c: i for i, c in enumerate(_CLAIM_ORDER)}
    generic = lambda f: f.evidence.get("pattern") == "generic"  # noqa: E731
    # a swap replaces every kernel of its chains, an elementwise op off the vectorized path or a cast among them:
    # it claims them before the fallback findings that would fix those one at a time (Phi-3's rope: q·cos)
    swap_chain = lambda f: f.category == "unfused_chain" and bool(f.recommendation.swap)  # noqa: E731
    ranked = sorted(findings, key=lambda f: (not swap_chain(f), order.get(f.category, len(order)), generic(f)))
    owner: dict = {}  # kernel -> the finding that claimed it
    copies: set = set()  # device copies claimed (they go with their op's kernels)
    kept = []
    for f in ranked:
        mine = f.change.kernels
        overlap = {k for k in mine if k in owner}
        if overlap:
            if overlap == mine:
                claimant = owner[next(iter(overlap))]
                claimant.evidence.setdefault("related", []).append(f.title)
                claimant.detail += f" Related: {f.title}."
                continue
            f.whole_change = f.change
            f.change = f.change.without_kernels(overlap, kernel_dur)
            f.evidence["kernels_claimed_elsewhere"] = len(overlap)
        if f.change.copies_removed & copies:
            f.change = replace(f.change, copies_removed=f.change.copies_removed - copies)
        copies |= f.change.copies_removed
        for k in mine - overlap:
            owner[k] = f
        kept.append(f)
    return kept


def _gpu_time_saved(trace: Trace, change: Change) -> float:
    """Kernel and device-copy time the change frees per step, over the whole window."""
    k = trace.kernels
    saved = 0.0
    if change.durations:
        rows = list(change.durations)
        saved += float((k["dur"].to_numpy()[rows] - np.fromiter(change.durations.values(), float, len(rows))).sum())
    if change.removed:
        saved += float(k["dur"].to_numpy()[list(change.removed)].sum())
    if change.copies_removed:
        saved += float(trace.memory["dur"].to_numpy()[list(change.copies_removed)].sum())
    saved -= sum(change.gpu_added.values())
    if change.graphs:
        saved += 0.0  # graphs remove host time and launch latency, not kernel time
    return saved / trace.step_count


# -- calibration ---------------------------------------------------------------------------------------

def _calibration(trace: Trace, timeline: Timeline) -> tuple[HostCost, dict]:
    """The profiler's cost per event that makes the replay take the unprofiled step time capture measured."""
    unprofiled = unprofiled_step_us(trace)
    power = _power_cap(trace)
    if not unprofiled:
        return HostCost(), {"measured": False, **power,
                     "note": "no unprofiled step time in the trace (capture with profiler_svc.capture and a "
                             "schedule to get one): host-side figures are upper bounds, inflated by the profiler"}
    replayed = timeline.baseline  # shared with calibrate: one replay of the trace as profiled
    if not replayed.loop_step_us / UNPROFILED_RATIO_MAX <= unprofiled <= replayed.loop_step_us * UNPROFILED_SLOWER_MAX:
        return HostCost(), {"measured": False, **power, "note": (
            f"the unprofiled step in the trace's metadata ({fmt_us(unprofiled)}) cannot be this trace's step "
            f"(profiled: {fmt_us(replayed.loop_step_us)}), so it is not used: host-side figures are upper bounds, "
            "inflated by the profiler")}
    host_step = _metadata_us(trace, "host_step_us")
    calibration = calibrate(timeline, unprofiled, host_step * replayed.steps if host_step else None)
    if calibration.host.per_event_us > PROFILER_US_PER_EVENT_MAX:
        return HostCost(), {"measured": False, **power, "note": (
            f"the unprofiled step ({fmt_us(unprofiled)}) would need {calibration.host.per_event_us:.0f} µs of profiler "
            f"cost taken off each recorded event of the host's calls (it is 1-20 µs in captured traces): work this "
            "trace does not record holds the host (threads whose ops the profiler missed, such as DataParallel's), so "
            "host-side figures are left as profiled, upper bounds")}
    profiled = replayed.loop_step_us
    out: dict[str, object] = {
        "measured": True, "unprofiled_step_us": round(unprofiled, 2), "profiled_step_us": round(profiled, 2),
        "profiler_inflation_pct": round(100 * (profiled / unprofiled - 1), 1),
        "profiler_us_per_event": round(calibration.host.per_event_us, 2), "host_scale": round(calibration.host_share, 3),
        **power}
    loop_steps = _timed_steps_us(trace)
    if len(loop_steps) >= 2:
        fastest, slowest = min(loop_steps), max(loop_steps)
        out["unprofiled_steps_us"] = [round(fastest, 2), round(slowest, 2)]
        spread = slowest / fastest - 1
        if spread > UNSTEADY_SPREAD:
            out["spread_note"] = (f"capture's {len(loop_steps)} timed unprofiled steps differ by {spread:.0%} "
                                  f"({fmt_us(fastest)}-{fmt_us(slowest)}): the host's pace moved while they ran, "
                                  f"and the calibration is that much less certain; a longer schedule `wait` times more")
    if calibration.host_measured:
        out["host_step_us"] = round(host_step or 0.0, 2)
        samples = _unprofiled(trace).get("host_steps_us")
        timed = (f"the fastest of the {len(samples)} steps capture timed on the host alone"
                 if isinstance(samples, list) and len(samples) > 1 else "the step capture timed on the host alone")
        out["note"] = (f"the GPU bounds the step and hides the host behind it: host time is taken from {timed} "
                       f"({fmt_us(host_step or 0.0)}), so a GPU saving counts only as far as the host leaves room")
    elif calibration.hidden_host:
        out["note"] = (f"the GPU bounds the step and hides the host behind it: host time is taken as long as it "
                       f"can be without lengthening the step by over {GPU_BOUND_SLACK:.0%}, so a GPU saving "
                       f"counts only as far as the host leaves room")
    return calibration.host, out


def _power_cap(trace: Trace) -> dict:
    """{"gpu_clocks", "power_note"} where capture's readings (docs/capture.md, "unprofiled") name the power cap in
    at least half of them and their median SM clock is over 1 - POWER_CAPPED_CLOCK below its maximum, else {}:
    there a fix that removes memory-bound kernels raises the power draw, and the GPU lowers the clock of the
    compute-bound kernels the replay keeps at their traced times."""
    clocks = _unprofiled(trace).get("gpu_clocks")
    if not isinstance(clocks, dict):
        return {}
    sm, top, limit = (_positive(clocks.get(key)) for key in ("sm_mhz", "max_sm_mhz", "power_limit_w"))
    samples, capped = clocks.get("samples"), clocks.get("power_capped")
    if type(samples) is not int or type(capped) is not int or sm is None or top is None or limit is None \
            or max(sm, top, limit, samples) > _GPU_FIGURE_MAX or not 0 < samples <= 2 * capped <= 2 * samples \
            or sm > POWER_CAPPED_CLOCK * top:
        return {}
    return {"gpu_clocks": {"sm_mhz": sm, "max_sm_mhz": top, "power_limit_w": limit, "samples": samples,
                           "power_capped": capped},
            "power_note": (f"the {limit:.0f} W power cap held the GPU's SM clock at {sm:.0f} of {top:.0f} MHz "
                           f"in {capped} of the {samples} steps timed: a fix that removes memory-bound kernels raises the power draw, and the GPU "
                           f"then clocks its compute-bound kernels lower still, which the replay, keeping them at "
                           f"their traced times, does not see; a GPU-side saving here is an upper bound")}


def _timed_steps_us(trace: Trace) -> list[float]:
    """The unprofiled steps capture timed for the loop's step (its warm-up one left out, as its median does);
    [] where the metadata does not hold them as positive numbers, index by index."""
    info = _unprofiled(trace)
    steps, indices = info.get("steps_us"), info.get("step_indices")
    if not (isinstance(steps, list) and isinstance(indices, list) and len(steps) == len(indices)):
        return []
    timed = [_positive(us) for index, us in zip(indices, steps)
             if isinstance(index, int) and not isinstance(index, bool) and index > 0]
    return [us for us in timed if us is not None]


def unprofiled_step_us(trace: Trace) -> Optional[float]:
    """The step time capture measured outside the profiler (median over the steps it timed), if any."""
    return _metadata_us(trace, "step_us")


def _unprofiled(trace: Trace) -> dict:
    """Capture's timing of the unprofiled steps (docs/capture.md, "unprofiled"), or {} where there is none."""
    info = trace.capture_metadata.get("unprofiled")
    return info if isinstance(info, dict) else {}


def _metadata_us(trace: Trace, key: str) -> Optional[float]:
    """A positive µs figure of capture's unprofiled timing ("step_us", "host_step_us"), if any."""
    return _positive(_unprofiled(trace).get(key))


def _positive(value) -> Optional[float]:
    """VALUE (µs, MHz, W) as a float where the metadata holds a number there from 1 to a day's µs, else None (an
    integer of hundreds of digits, valid JSON, has no float; no step, clock or power limit is below 1)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if 1.0 <= number <= _METADATA_MAX else None


# -- steps ---------------------------------------------------------------------------------------------

def _steps_summary(trace: Trace, timeline: Timeline, base, host: HostCost, calibration: dict,
                   findings: list) -> dict:
    measured = timeline.measured
    steps = measured.step_us
    sens = sensitivity(timeline, host=host)
    return {
        "count": int(len(trace.steps)),
        "source": trace.steps_source,
        "replayed": int(measured.steps),
        "step_us": _spread(steps),
        "replay_error_pct": round(timeline.error_pct, 2),
        "calibration": calibration,
        "bottleneck": _data_parallel_bound(trace, findings) or _bottleneck(trace, sens, base),
        "breakdown_us_per_step": _breakdown(trace),
        "idle": _idle(trace, findings),
        "phases": _phases(trace),
    }


def _idle(trace: Trace, findings: list) -> dict:
    """The GPU's idle breakdown: the launch-gaps finding's where there is one (its detector worked it out),
    else worked out here."""
    for f in findings:
        if f.category == "launch_gaps" and "idle_breakdown" in f.evidence:
            return f.evidence["idle_breakdown"]
    return idle_breakdown(trace)


def _steps_without_gpu(trace: Trace) -> dict:
    start, end = trace.window
    return {"count": int(len(trace.steps)), "source": trace.steps_source, "replayed": 0,
            "step_us": _spread(trace.steps["dur"].to_numpy(float) if len(trace.steps) else np.array([end - start])),
            "bottleneck": {"kind": "host", "detail": "no GPU activity in the trace: the host is all there is"}}


def _spread(values: np.ndarray) -> dict:
    values = np.asarray(values, dtype=float)
    if not len(values):
        return {"median": 0.0, "min": 0.0, "max": 0.0, "values": []}
    return {"median": round(float(np.median(values)), 2), "min": round(float(values.min()), 2),
            "max": round(float(values.max()), 2), "values": [round(float(v), 2) for v in values[:64]]}


def _bottleneck(trace: Trace, sens: dict, base) -> dict:
    """What bounds the step, from how the replayed step answers halving host or GPU time."""
    k = trace.window_kernels
    total = float(k["dur"].sum()) or 1.0
    comm = float(k.loc[name_mask(k, is_communication), "dur"].sum())
    compute = float(k.loc[name_mask(k, is_compute_bound_kernel), "dur"].sum())
    host, gpu = sens["host"], sens["gpu"]
    wait_share = base.host_wait_us / base.total_us if base.total_us else 0.0
    figures = {"host_sensitivity": round(host, 3), "gpu_sensitivity": round(gpu, 3),
               "host_wait_share": round(wait_share, 3)}
    if max(host, gpu) < 0.2 and _collective_host_time(trace) > 0.3 * trace.span_us:
        kind, detail = "communication", ("neither faster host nor faster kernels shorten the step: it waits in "
                                         "collectives")
    elif comm > 0.3 * total and gpu >= host:
        kind, detail = "communication", "collective kernels take most of the GPU time"
    elif host > gpu + _BOUND_MARGIN:
        if wait_share > 0.3:
            kind, detail = "synchronization", "the host spends the step blocked in syncs, then launches late"
        else:
            kind, detail = "launch overhead", ("the GPU waits for the host to launch work: halving host time would "
                                               f"shorten the step by {100 * host / 2:.0f}%. What a fix saves here is "
                                               "host time at this capture's pace: on a shared or virtual host whose "
                                               "pace moves, its ms move with it, its share of the step far less")
    elif gpu > host + _BOUND_MARGIN or gpu >= 0.5:
        if compute >= 0.5 * total:
            kind, detail = "compute", "GEMMs, convolutions and attention take most of the kernel time"
        else:
            kind, detail = "memory bandwidth", "memory-bound kernels take most of the kernel time"
    else:
        kind, detail = "balanced", "host and GPU each bound parts of the step"
    return {"kind": kind, "detail": detail, **figures}


def _data_parallel_bound(trace: Trace, findings: list) -> Optional[dict]:
    """Under DataParallel the GPUs wait on one process's replica threads, whose ops the replay cannot see: the
    host bounds the step however its halving answers."""
    for f in findings:
        if f.key == DATA_PARALLEL_KEY:
            busy = 100 * trace.gpu_busy_us / trace.span_us if trace.span_us else 0.0
            return {"kind": "launch overhead", "detail": (
                f"torch.nn.DataParallel's replica threads launch every GPU's work from one process: the GPUs are busy "
                f"{busy:.0f}% of the window")}
    return None


def _collective_host_time(trace: Trace) -> float:
    """Host time inside collective calls: their union, as c10d's op and the backend's nest inside each other."""
    return float(time_covered_by(trace.collectives)(np.inf)) if trace.collectives else 0.0


def _breakdown(trace: Trace) -> dict:
    """Per step: compute-bound kernels, memory-bound kernels, memcpy/memset, communication, and GPU idle."""
    k = trace.window_kernels
    comm = name_mask(k, is_communication)
    compute = name_mask(k, is_compute_bound_kernel) & ~comm
    start, end = trace.window
    m = trace.memory
    mem = m[(m["ts"] >= start) & (m["ts"] <= end)]
    n = trace.step_count
    busy = trace.gpu_busy_us
    return {
        "compute_kernels": round(float(k.loc[compute, "dur"].sum()) / n, 2),
        "memory_kernels": round(float(k.loc[~compute & ~comm, "dur"].sum()) / n, 2),
        "communication": round(float(k.loc[comm, "dur"].sum()) / n, 2),
        "memcpy_memset": round(float(mem["dur"].sum()) / n, 2),
        "gpu_idle": round(max(0.0, trace.span_us - busy) / n, 2),
    }


def _phases(trace: Trace) -> Optional[dict]:
    """Generation: the prefill (the step's first forward) and the decode tokens after it, which the host reads
    one at a time. A blocking call per token splits the step into segments; they are a decode loop when the
    tokens repeat one forward (about the same number of kernels each)."""
    from ..trace.replay import BLOCKING_CALLS
    steps = trace.steps
    if not len(steps):
        return None
    runtime = trace.runtime
    first = steps.iloc[0]
    syncs = runtime[runtime["name"].isin(BLOCKING_CALLS).to_numpy() & (runtime["ts"] >= first["ts"]).to_numpy()
                    & (runtime["ts"] <= first["end"]).to_numpy()].sort_values("ts")
    if len(syncs) < _MIN_DECODE_TOKENS:
        return None
    bounds = np.r_[first["ts"], syncs["end"].to_numpy()]
    launches = runtime[runtime["name"].str.contains("Launch").to_numpy()]["ts"].to_numpy()
    kernels = np.diff(np.searchsorted(np.sort(launches), bounds))
    tokens = kernels[1:]
    typical = float(np.median(tokens))
    alike = np.abs(tokens - typical) <= 0.1 * typical
    if typical < 10 or alike.mean() < 0.75 or kernels[0] < 0.8 * typical:
        return None
    spans = np.diff(bounds)
    prefill, per_token = float(spans[0]), float(np.median(spans[1:]))
    return {"prefill_us": round(prefill, 2), "decode_tokens": int(len(tokens)),
            "decode_us_per_token": round(per_token, 2),
            "note": f"first step: prefill {fmt_us(prefill)}, then {len(tokens)} tokens at {fmt_us(per_token)} each "
                    "(median)"}


__all__ = ["Analysis", "Finding", "analyse", "unprofiled_step_us"]
