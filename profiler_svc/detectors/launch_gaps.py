"""Launch gaps: GPU idle inside the window, split by cause.

- host-wait: the kernel that ended the gap was launched after the GPU went idle (the CPU was late:
  Python, dispatcher, launch overhead)
- sync-caused: the host was blocked in a synchronization just before (reported by host_sync)
- kernel-to-kernel: work was queued but the GPU still idled (dependencies, stream waits, tiny kernels)
"""
import numpy as np

from ..trace.model import Trace
from .common import Finding, Recommendation, fmt_us, name_mask, short_kernel_name, steps_note, window_kernels
from .gpu_idle import blocking_calls, idle_gaps, launch_times

# Gaps shorter than this are the normal kernel-switch cost, not something to fix.
_MIN_GAP_US = 2.0
# Report a cause when its idle time is at least this share of the window.
_MIN_SHARE = 0.03


def classify_gaps(trace: Trace):
    gaps = idle_gaps(trace)
    if not len(gaps.start):
        return gaps, np.zeros(0, dtype=object)
    launched = launch_times(trace, gaps.gpu)[gaps.next_row]
    syncs = blocking_calls(trace)
    sync_end = np.sort(syncs["end"].to_numpy())
    kind = np.full(len(gaps.start), "kernel_to_kernel", dtype=object)
    late = ~np.isnan(launched) & (launched >= gaps.start - 0.5)
    kind[late] = "host_wait"
    if len(sync_end):
        # a blocking call returned inside the gap, before the launch that ended it
        i = np.searchsorted(sync_end, gaps.start, side="left")
        i = np.minimum(i, len(sync_end) - 1)
        returned = sync_end[i]
        limit = np.where(np.isnan(launched), gaps.end, launched)
        kind[late & (returned >= gaps.start - 1.0) & (returned <= limit)] = "sync"
    kind[gaps.dur < _MIN_GAP_US] = "short"
    return gaps, kind


def detect(trace: Trace) -> list[Finding]:
    if not trace.has_gpu:
        return []
    gaps, kind = classify_gaps(trace)
    span = trace.span_us
    if not len(gaps.start) or span <= 0:
        return []
    dur = gaps.dur
    findings = []
    in_window = window_kernels(trace)
    runtime = trace.runtime
    launch_dur = runtime[name_mask(runtime, lambda n: "Launch" in n)]["dur"]
    median_launch = float(launch_dur.median()) if len(launch_dur) else None
    short = in_window[in_window["dur"] < 10.0]
    for cause in ("host_wait", "kernel_to_kernel"):
        mask = kind == cause
        idle = float(dur[mask].sum())
        if idle < _MIN_SHARE * span:
            continue
        worst = np.argsort(-dur * mask)[:5]
        examples = []
        for g in worst:
            if not mask[g]:
                continue
            nxt = gaps.gpu.iloc[gaps.next_row[g]]
            examples.append({"start_us": round(float(gaps.start[g]), 2), "idle_us": round(float(dur[g]), 2),
                             "next_kernel": short_kernel_name(nxt["name"], 80), "next_op": nxt["top_op_name"],
                             "module": nxt["module"], "host_ops_during_gap": _host_ops(trace, gaps.start[g], gaps.end[g])})
        if cause == "host_wait":
            title = f"GPU idle {100 * idle / span:.0f}% of the time waiting for the CPU to launch work"
            detail = (f"{int(mask.sum())} gaps totalling {fmt_us(idle)} {steps_note(trace)} ({100 * idle / span:.1f}% of "
                      f"{fmt_us(span)}) ended with a kernel the CPU launched only after the GPU had gone idle. "
                      f"{len(short)} of {len(in_window)} kernels run under 10 µs"
                      + (f" while a launch call takes {median_launch:.1f} µs (median)" if median_launch else "")
                      + ": the step is launch-bound.")
            rec = Recommendation(
                "Remove per-kernel launch cost: capture the step in a CUDA graph (torch.compile mode=\"reduce-overhead\" "
                "does it), fuse small ops, or give each launch more work (larger batch).",
                None, 'model = torch.compile(model, mode="reduce-overhead")  # CUDA graphs')
            savings = idle  # upper bound: a graph replays with near-zero gaps
        else:
            title = f"GPU idle between queued kernels: {fmt_us(idle)}"
            detail = (f"{int(mask.sum())} gaps totalling {fmt_us(idle)} {steps_note(trace)} occurred although the next "
                      "kernel had already been launched: stream dependencies, event waits or device-side scheduling.")
            rec = Recommendation("Check cross-stream waits and host-to-device copies on the critical path; overlap them "
                                 "with compute on separate streams (pinned memory, non_blocking=True).", None,
                                 "x = x.pin_memory().to(device, non_blocking=True)")
            savings = max(0.0, idle - _MIN_GAP_US * int(mask.sum()))
        findings.append(Finding(
            category="launch_gaps", title=title, detail=detail,
            evidence={"cause": cause, "gaps": int(mask.sum()), "idle_us": round(idle, 2),
                      "idle_pct": round(100 * idle / span, 2), "window_us": round(span, 2),
                      "gpu_busy_pct": round(trace.gpu_busy_pct, 2),
                      "sync_idle_us": round(float(dur[kind == "sync"].sum()), 2),
                      "kernels_under_10us": int(len(short)), "kernels": int(len(in_window)),
                      "median_launch_us": round(median_launch, 2) if median_launch else None,
                      "largest_gaps": examples},
            estimated_savings_us=savings, recommendation=rec, key=f"launch_gaps:{cause}",
        ))
    return findings


def _host_ops(trace, start, end, limit=3):
    """The outermost CPU ops running while the GPU sat idle: what the host was busy with."""
    cpu = trace.cpu
    busy = cpu[(cpu["ts"] < end) & (cpu["end"] > start) & (cpu["cat"] == "cpu_op") & (cpu["top"] == cpu.index)]
    return busy.sort_values("ts")["name"].head(limit).tolist()
